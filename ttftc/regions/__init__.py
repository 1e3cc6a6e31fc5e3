"""Regional compilation: compile each distinct repeated block (decoder layer) of a graph once and rebind the
compiled code to every other block's weights (partition.py, recipe.py, compile.py, backend.py)."""
