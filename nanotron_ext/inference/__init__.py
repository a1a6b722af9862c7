"""Using a trained run outside training: open its checkpoint, reassemble its shards, run the model on one process.

- run.py: a run folder -> its config and checkpoint (`open_run`); the shards of any layout (dp x tp x pp, any TP
  strategy) reassembled into full tensors by spawning the run's layout as gloo CPU processes (`gather`), which
  also state the model's dense equivalent for export and compute check logits in the run's own layout
- model.py: the run's model on one process (tp = pp = 1, codec boundaries kept where the run had them), loaded
  from the reassembled tensors, and its logits
- generation.py: sampling (greedy, temperature, top-p), on our model or on its transformers twin with a KV cache
- perplexity.py: loss, perplexity and bits per byte of a model on local text, cut into the trainer's windows

Entry points: `python -m nanotron_ext.export`, `python -m nanotron_ext.generate`, `python -m nanotron_ext.eval`.
"""
