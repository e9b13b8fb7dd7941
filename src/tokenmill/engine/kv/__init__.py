"""The KV cache's bookkeeping: the block pool, the radix prefix tree, the disk tier and its folder, host memory, KV events out."""
