"""The model library over the Hugging Face hub: search, files, checked and resumable downloads into the HF cache,
what a hub answer may put on the file system, and whether a model fits this machine. Torch-free until a fit
estimate is asked for; never imported by the engine."""
