"""Other stacks' memory APIs spoken over torch_budget, so their users change one import.

    torch_memory_saver   torch_memory_saver's singleton (region, pause, resume, cuda_graph,
                         disable, ...) over region() and release() / restore()
    vllm                 vLLM's general plugin (install() in every vLLM process), CuMemAllocator's
                         surface and a sleep-mode backend named "torch_budget"
    tensorrt_llm         TensorRT-LLM's virtual memory: scope(tag, mode), RestoreMode,
                         release_with_tag, materialize_with_tag
    sglang               an SGLang plugin pointing its memory-saver adapter at torch_memory_saver's

What one cannot honour raises torch_budget.errors.UnsupportedError. Importing an adapter
installs torch_budget when a CUDA device is there and CUDA has not started.
"""
