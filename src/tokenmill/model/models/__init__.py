"""Model families: the Llama-family decoder, Gemma, Phi-3, mixture-of-experts, their shared layers, and which class runs which architecture."""
