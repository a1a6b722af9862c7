"""The bridge to Hugging Face transformers: export a run as a folder `AutoModelForCausalLM.from_pretrained` loads,
and start a run from such a folder (`model.init_from: hf:DIR`).

- names.py: our standard layout (nanotron_ext.models.dense) <-> transformers' LlamaForCausalLM / Qwen3ForCausalLM
  parameter names, the transformers config of a ModelConfig and the check of a folder's config.json against it
- export.py: standard tensors -> transformers model in memory or on disk (safetensors, config, tokenizer)
- tokenizer.py: the run's `tokenizers` JSON as a PreTrainedTokenizerFast with our data pipeline's special tokens
- folder.py: a folder's safetensors headers, checked when the job starts (`model.init_from`)
- importer.py: `model.init_from`: a folder's tensors under our standard names and the per-layer reconstruction
  error table; nanotron_ext.models.init_from loads them into a model of any layout (factorised targets from a
  truncated SVD)

transformers itself is optional (`pip install '.[hf]'`): only export.py and tokenizer.py need it; reading a
folder for import uses safetensors (a dependency of nanotron) and JSON.
"""
