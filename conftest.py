"""pytest on any machine: the notebooks are compared (nbval) with their committed outputs of a quick CPU run, so
every kernel that nbval starts inherits a quick profile on the CPU, on a laptop, a GPU machine or a TPU host alike.
The GPUs are hidden too (CUDA_VISIBLE_DEVICES=""): a library that picks the GPU by itself (fastai's Learner in
chapter 04) would otherwise print another line on a GPU machine. Plain `pytest --nbval notebooks/` needs no other flag
(pyproject.toml adds the sanitizer and the environment); the GPU paths run in `make device-check`."""

import os

os.environ["ACCEL_PROFILE"] = "quick"
os.environ["ACCEL_DEVICE"] = "cpu"
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("TQDM_DISABLE", "1")  # progress bars are not outputs to compare
