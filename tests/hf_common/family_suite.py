"""The pytest module the harness runs in a subprocess: one test class per family in SWIGLU_HF_FAMILIES
(comma-separated), each transformers' common mixins over OUR FamilyModelTester. Needs the assembled
`hf_sdist_tests` package (hf_common.sdist.assemble) and this `tests/` folder on sys.path."""
import os

from hf_common.tester import make_test_case

_case = None
for _family in filter(None, os.environ.get("SWIGLU_HF_FAMILIES", "").split(",")):
    _case = make_test_case(_family)
    globals()[_case.__name__] = _case
del _family, _case
