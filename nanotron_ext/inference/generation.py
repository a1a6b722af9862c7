"""Sampling text from a model, one token at a time, with one sampler for every backend:

- native: our one-process model (any technique), the whole sequence re-run for each new token (our attention
  layers keep no KV cache);
- hf: the model's transformers twin (nanotron_ext.hf.export.hf_model) with its KV cache, for models that have a
  dense equivalent; greedy decoding gives the same tokens as native (tested).

Sampling: temperature 0 is greedy (argmax); otherwise softmax(logits / temperature), cut to the smallest set of
tokens whose probability reaches top_p (nucleus sampling), drawn from a generator seeded by `seed`.
"""
from __future__ import annotations

import inspect
from typing import Callable, List, Optional

import torch

NextLogits = Callable[[List[int]], torch.Tensor]
"""ids so far -> fp32 logits [V] of the next token."""


def native_next_logits(model: torch.nn.Module) -> NextLogits:
    from nanotron_ext.inference.model import logits

    def step(ids: List[int]) -> torch.Tensor:
        return logits(model, torch.tensor([ids]))[0, -1]

    return step


def cache_name(model: torch.nn.Module) -> str:
    """The KV cache's keyword (and output field) in this transformers: `cache` since it renamed `past_key_values`
    (the old name then prints two deprecation warnings into the user's output), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_next_logits(model: torch.nn.Module) -> NextLogits:
    """transformers model with its KV cache: each call feeds only the ids it has not seen."""
    state = {"cache": None, "seen": 0}
    name = cache_name(model)

    @torch.no_grad()
    def step(ids: List[int]) -> torch.Tensor:
        new = torch.tensor([ids[state["seen"]:]])
        out = model(input_ids=new, use_cache=True, **{name: state["cache"]})
        state["cache"], state["seen"] = getattr(out, name), len(ids)
        return out.logits[0, -1].float()

    return step


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token id from next-token `logits` [V] (see the module doc)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # probability of the tokens ranked above each one
        sorted_probs[before >= top_p] = 0  # keep every token until the kept mass reaches top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def generate(next_logits: NextLogits, prompt: List[int], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, eos_id: Optional[int] = None, max_length: Optional[int] = None,
             on_token: Optional[Callable[[int], None]] = None) -> List[int]:
    """The new token ids after `prompt` (stops after `max_new_tokens`, at `eos_id`, or at `max_length` tokens in
    all: the RoPE tables our model was built with end there)."""
    if not prompt:
        raise ValueError("generation needs at least one prompt token")
    generator = torch.Generator().manual_seed(seed)
    ids, new = list(prompt), []
    while len(new) < max_new_tokens and (max_length is None or len(ids) < max_length):
        token = sample(next_logits(ids), temperature, top_p, generator)
        ids.append(token)
        new.append(token)
        if on_token is not None:
            on_token(token)
        if token == eos_id:
            break
    return new
