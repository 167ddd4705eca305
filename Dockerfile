# megatron_ext on NGC PyTorch (Python 3.12, CUDA torch, transformer-engine, apex, flash-attn
# included) with megatron-core 0.19.x. 26.06 is the base of Megatron-LM's own CI image
# (docker/Dockerfile.ci.dev); megatron-core 0.19 ships wheels for Python 3.12 only.
# Every command below RUNs is in tools/docker_steps.sh, which CI also runs (without the base
# image); keep install logic there, not here.
#
#   docker build -t megatron-ext .
#   docker run --gpus all --ipc=host megatron-ext \
#       torchrun --nproc_per_node 8 examples/pretrain_gpt.py <Megatron-LM flags> [--strategy-config plan.json]
FROM nvcr.io/nvidia/pytorch:26.06-py3

WORKDIR /opt/megatron_ext
COPY . /opt/megatron_ext
RUN bash tools/docker_steps.sh /opt/megatron_ext

ENV PYTHONUNBUFFERED=1
# NGC's entrypoint (driver/CUDA checks), then whatever command is given: torchrun, megatron-ext.
ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh"]
CMD ["bash"]
