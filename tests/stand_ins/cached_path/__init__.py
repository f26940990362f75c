"""A stand-in for ``cached_path``, put on ``sys.path`` only while
tests/test_training_libraries.py imports OLMo-core without it installed: the
real package imports the Google Cloud, AWS and Hugging Face clients at import
time, and OLMo-core's config module imports ``cached_path`` at import time;
no test reads a remote or cached file. Calling it says so."""


def cached_path(*args, **kwargs):
    raise RuntimeError("cached_path stand-in (tests/stand_ins): no file can be fetched in these tests")
