"""pipetrain: pipeline-parallel training of GPT-2 and LLaMA-3 on PyTorch, Lightning and Hydra."""

__version__ = "0.1.0"
