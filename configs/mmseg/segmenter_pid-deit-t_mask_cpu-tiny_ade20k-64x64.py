# A CPU-sized version of the PID Segmenter config, for smoke tests and the README: 64x64 crops, a 2-layer
# backbone, a few iterations. Point data_root at a folder in ADE20K layout, e.g. one made by
#   python -c "from research.mmseg_data import make_ade20k_like; make_ade20k_like('data/ade_tiny')"
_base_ = './segmenter_pid-deit-t_mask_8xb1-160k_ade20k-512x512.py'

crop_size = (64, 64)
data_root = 'data/ade_tiny'
model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(img_size=crop_size, num_layers=2, drop_path_rate=0.0),
    decode_head=dict(num_layers=1),
    test_cfg=dict(mode='whole'),
)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', reduce_zero_label=True),
    dict(type='PackSegInputs'),
]
train_dataloader = dict(batch_size=4, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root, pipeline=train_pipeline))
val_dataloader = dict(batch_size=1, num_workers=0, persistent_workers=False,
                      dataset=dict(data_root=data_root, pipeline=test_pipeline))
test_dataloader = val_dataloader
train_cfg = dict(type='IterBasedTrainLoop', max_iters=4, val_interval=2)
param_scheduler = [dict(type='PolyLR', eta_min=1e-4, power=0.9, begin=0, end=4, by_epoch=False)]
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=1, log_metric_by_epoch=False),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=2),
)
env_cfg = dict(cudnn_benchmark=False, dist_cfg=dict(backend='gloo'))
