"""Codegen: lowering of ttftc ops to per-device providers (triton/, npu/, cpu/), with the torch reference as floor."""
