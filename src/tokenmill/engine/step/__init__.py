"""One engine step: the frozen step batch, the runner and its executors (eager, fused CPU, CUDA graphs, tensor-parallel), prompt logprobs."""
