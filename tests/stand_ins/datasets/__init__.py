"""A stand-in for Hugging Face ``datasets``, put on ``sys.path`` only while
tests/test_training_libraries.py imports torchtune without it installed:
torchtune's dataset builders import ``load_dataset`` at import time; no test
loads a data set. Calling it says so."""


def load_dataset(*args, **kwargs):
    raise RuntimeError("datasets stand-in (tests/stand_ins): no data set can be loaded in these tests")
