"""What a replica tells others about its traffic: captured requests, cache-miss reasons, KV cache events."""
