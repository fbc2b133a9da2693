"""The baselines, each in the form its users run it (docs/baselines.md): static.py
(bucket, static_tuned, packed), videosys/ (the published DCP-intra, DCP-inter and PAC, with
their profile stage and stream samplers), megatron.py (Megatron-Core's dynamic context
parallelism), verl.py (verl's balanced micro-batches)."""
