"""What the router knows of replicas' caches: the approximate prefix index and the index fed by KV events."""
