#!/bin/bash
# A Megatron-LM launch script of the usual shape, for the docs' examples (tests/test_docs_examples.py):
# GPT-3 175B as Table 3 trains it, on 8 nodes of 8 GPUs.
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NUM_NODES=${NUM_NODES:-8}
CHECKPOINT_PATH=$1
GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend local
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 64
    --bf16
    --lr 6.0e-5
    --clip-grad 1.0
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 8
    --sequence-parallel
    --recompute-activations
    --use-distributed-optimizer
)
DATA_ARGS=(
    --tokenizer-type GPT2BPETokenizer
    --vocab-file gpt2-vocab.json
    --merge-file gpt2-merges.txt
    --no-create-attention-mask-in-dataloader
)
torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NUM_NODES pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS[@]} \
    --save $CHECKPOINT_PATH --log-interval 100
