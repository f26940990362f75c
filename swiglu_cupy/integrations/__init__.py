"""Other people's models and engines: the one model walk ``patch`` and the
fused-module machinery it installs (``patching``), Hugging Face dense MLPs
(``hf``) and MoE experts (``hf_experts``), xformers' SwiGLU API
(``xformers``), and tensor parallelism (``parallel``). Built on the dense and
MoE ops; nothing below imports from here."""
