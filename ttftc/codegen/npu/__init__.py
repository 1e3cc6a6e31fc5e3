"""Ascend NPU lowerings to torch_npu fused ops. Untested on hardware: checked only against a recording stand-in."""
