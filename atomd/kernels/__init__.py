"""The C kernels (csrc/) and their builder: what the engine and the grammar bitmask call."""
