"""The research code's six benchmark command lines (seed 004), shared by the tests that run or parse them."""

SEED_LINES = [  # the research code's README (seed 004), verbatim after `python benchmark.py`
    "--batchsize 64 --batches 1000 xnvme-gds --uri /dev/libnvm0 --mem cpu --bmap imagenet_train_bmap.json",
    "--batchsize 64 --batches 1000 xnvme-gds --uri /dev/libnvm0 --mem gpu --bmap imagenet_train_bmap.json",
    "--batchsize 64 --batches 1000 xnvme-bam --uri /dev/libnvm0 --bmap imagenet_train_bmap.json",
    "--batchsize 64 --batches 1000 dali --datadir /data",
    "--batchsize 64 --batches 1000 python-file --datadir /data",
    "--batchsize 64 --batches 1000 xnvme-file --datadir /data",
]
