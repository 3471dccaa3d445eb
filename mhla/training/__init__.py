"""The training harness behind ``train.py`` and ``validate.py``: config, data and WebDataset shards (``shards``),
engine, trainer, checkpoints, fine-tuning starts (``finetune``), regional compilation (``compiling``),
distributed helpers, run logging and evaluation.

It builds on the attention library (``mhla``) and on timm; the library never imports it. Weights files are
read by ``mhla.weights`` (its ``WeightsError`` is the one error for a file that is missing, unreadable or
does not fit).
"""
