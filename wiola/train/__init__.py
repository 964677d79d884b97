"""Training Wiola models: ``train(TrainConfig(...))``.

``config`` (settings and the recipes in ``recipes/``), ``optim`` (AdamW and the schedule),
``env`` (device, precision, process group), ``data`` and ``corpus`` (documents to token windows),
``loop`` (the training loop), ``evaluate`` (validation numbers and gate statistics), ``plots``
and ``run_folder`` (checkpoints and metrics). Needs the ``train`` extra
(``pip install 'wiola-slm[train]'``: tqdm, matplotlib, datasets); importing this package does not.
"""

from wiola.train.config import TrainConfig, recipe, recipe_names
from wiola.train.loop import TrainingDiverged, TrainResult, build_model, train

__all__ = ["TrainConfig", "TrainResult", "TrainingDiverged", "build_model", "recipe", "recipe_names", "train"]
