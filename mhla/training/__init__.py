"""The training harness behind ``train.py`` and ``validate.py``: config, data, engine, trainer, checkpoints,
distributed helpers, run logging and evaluation.

It builds on the attention library (``mhla``) and on timm; the library never imports it.
"""
