"""A stand-in for ``torchao``, put on ``sys.path`` only while
tests/test_training_libraries.py (and the ranks of
test_training_libraries_sharded.py) import torchtune without it: torchtune
0.6.1 imports ``torchao.dtypes.nf4tensor`` (QLoRA's NF4 weights) at import
time, which the torchao releases that peft accepts (>0.16) no longer have,
and an older torchao installed beside peft breaks peft's import of its
LoRA layers. ``torchtune.training`` also imports torchao's quantizer names
(``quantization``). No test here quantizes a weight."""
