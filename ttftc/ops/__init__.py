"""The semantic ops: torch.ops.ttftc.*. Importing this package registers every op."""

from ttftc.ops import attention, ffn, int8_linear, linear, norm, norm_linear, rope  # noqa: F401  (registration side effect)
from ttftc.ops import quant  # noqa: F401  (registration side effect; after ffn, int8_linear, norm_linear)
from ttftc.ops.registry import OpDef, all_ops, get_op, op_name_of

__all__ = ["OpDef", "all_ops", "get_op", "op_name_of"]
