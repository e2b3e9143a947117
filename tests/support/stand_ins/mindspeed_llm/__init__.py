"""Stand-in for MindSpeed-LLM (see ../README.md): ``from mindspeed_llm import megatron_adaptor``
runs its adaptor, as the real package's ``__init__`` does."""

from mindspeed_llm.tasks import megatron_adaptor_v2 as megatron_adaptor  # noqa: F401
