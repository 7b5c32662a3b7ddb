"""The ``multimodal-fsdp`` command line: plans, costs and policy choices of a model preset."""
