"""A stand-in for ``torchvision``, put on ``sys.path`` only while
tests/test_training_libraries.py imports torchtune without it: the package of
torchtune 0.6.1's Llama-3.2-Vision builders imports its CLIP image transforms
(torchvision) at import time, and no torchvision build installs beside the
CPU torch here. The tests build only the text decoder; no image is
transformed. Using it says so."""
from . import transforms  # noqa: F401
