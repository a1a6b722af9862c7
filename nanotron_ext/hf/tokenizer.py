"""The run's tokenizer for transformers: the `tokenizers` JSON that `prepare` trained (or tokenizer.path named),
wrapped as a PreTrainedTokenizerFast with the special tokens our data pipeline uses. Documents are tokenised
without a BOS and end with `<|endoftext|>` (datatrove's DocumentTokenizer appends it), so that one token is EOS,
pad, and the BOS a generation starts from (what precedes a document in training); nothing is added on encode."""
from __future__ import annotations

from pathlib import Path

from nanotron_ext.data.prepare import EOS_TOKEN, load_tokenizer
from nanotron_ext.data.sources import DataError


def eos_id(tokenizer_json: Path) -> int:
    """The id of the document separator in the run's tokenizer."""
    found = load_tokenizer(tokenizer_json).token_to_id(EOS_TOKEN)
    if found is None:
        raise DataError(f"tokenizer {tokenizer_json} has no {EOS_TOKEN} token (the document separator)")
    return found


def hf_tokenizer(tokenizer_json: Path, max_length: int):
    """A transformers PreTrainedTokenizerFast over `tokenizer_json` (needs the `hf` extra)."""
    from transformers import PreTrainedTokenizerFast

    eos_id(tokenizer_json)  # a clear error for a tokenizer without the separator
    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), bos_token=EOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, model_max_length=max_length,
                                   clean_up_tokenization_spaces=False)
