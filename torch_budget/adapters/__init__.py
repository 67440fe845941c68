"""Other stacks' memory APIs spoken over torch_budget, so their users change one import.

    torch_memory_saver   torch_memory_saver's singleton (region, pause, resume, cuda_graph,
                         disable, ...) over region() and release() / restore()
"""
