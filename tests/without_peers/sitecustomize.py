"""Makes the optional packages named in SWIGLU_HIDE_PACKAGES look not installed.

Put this directory on PYTHONPATH and set SWIGLU_HIDE_PACKAGES to a
comma-separated list of top-level import names (``transformers,xformers``):
Python imports this file at start-up (``site`` imports ``sitecustomize``),
and from then on, in this process and in every process it starts with the
same environment, importing one of those names, or a submodule, raises
``ModuleNotFoundError`` just as it does when the package is absent,
``importlib.util.find_spec`` returns None for it, and ``importlib.metadata``
no longer lists its distribution (so pytest loads no plugin of it).
tests/test_tiers.py runs the quick tier this way.
"""
import importlib.machinery
import importlib.metadata
import os
import re
import sys

HIDDEN = frozenset(name.strip() for name in os.environ.get("SWIGLU_HIDE_PACKAGES", "").split(",") if name.strip())


def _normalized(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def _provides(dist):
    """The normalised distribution name and the top-level names it installs."""
    names = {_normalized(dist.metadata["Name"] or "")}
    top_level = dist.read_text("top_level.txt")
    if top_level is not None:
        return names | {_normalized(name) for name in top_level.split()}
    return names | {_normalized(f.parts[0].removesuffix(".py")) for f in dist.files or () if f.parts}


class _Hiding:
    """Wraps the path finder of ``sys.meta_path``: hidden names are not found."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in HIDDEN:
            return None
        find_spec = getattr(self._finder, "find_spec", None)
        return None if find_spec is None else find_spec(fullname, path, target)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        find = getattr(self._finder, "find_distributions", None)
        if find is None:
            return iter(())
        return (d for d in find(context) if not _provides(d) & {_normalized(name) for name in HIDDEN})

    def invalidate_caches(self):
        invalidate = getattr(self._finder, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()

    def __getattr__(self, name):
        return getattr(self._finder, name)


if HIDDEN:
    for name in [n for n in sys.modules if n.partition(".")[0] in HIDDEN]:
        del sys.modules[name]
    # Installed packages (and the tests' stand-ins on sys.path) are found by the
    # path finder; the other finders (frozen, built-in, editable installs of
    # this project) are left as they are.
    sys.meta_path[:] = [_Hiding(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
