"""Pure search logic: the ZeRO space, the memory model, the line bookkeeping, and the binary,
random and ASHA methods. Nothing here starts a process or touches a file: a searcher takes
results and returns the next trials.
"""
