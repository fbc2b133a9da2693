"""VideoSys' data-centric parallelism (NUS-HPC-AI-Lab/VideoSys @ 4cce477;
research/videosys_dcp.md) in the forms it runs in: methods.py (DCP-intra, DCP-inter and PAC
on one fixed batch), stream.py (the published samplers over an epoch), with sampler.py (the
sampler's mechanics both share) and profile.py (the emulated profile stage)."""
