# Segmenter (mask transformer) with a PID DeiT-tiny backbone on ADE20K: PIDformer's segmentation setting.
# mmseg's own config, with the backbone switched to PID (paper preset `segmenter`: 0.5, 0.3, 0.05, 1.0).
_base_ = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'
custom_imports = dict(imports=['pid_plugins.mmseg'], allow_failed_imports=False)
# load_from / resume / tools/test.py load weights only, whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says
custom_hooks = [dict(type='WeightsOnlyCheckpointHook')]

model = dict(
    # The paper initialises the backbone from an ImageNet (PID) DeiT, i.e. a timm DeiT checkpoint: it has a
    # patch-embedding bias and was trained on ImageNet-normalised images, so the backbone keeps the bias and
    # the data preprocessor uses ImageNet's mean/std (mmseg's Segmenter configs use 127.5, which suits the
    # weights they download). mmseg's `pretrained` download is dropped; point init_cfg at your checkpoint:
    #   backbone=dict(init_cfg=dict(type='Pretrained', checkpoint='/path/to/pid_deit_tiny.pth'))
    # (a timm DeiT/ViT checkpoint, softmax or PID, or an mmseg ViT checkpoint with a patch bias; strict).
    # attention_cfg=dict(preset='segmenter', control_first_layer=False): the group's first layer only records v^1
    # (NeuTRENO's convention); the default True controls it too (the paper's eq. 25 summed from layer 1).
    # PID in the mask-transformer decoder too (its own PID group; off by default):
    #   decode_head=dict(type='PIDSegmenterMaskTransformerHead', attention='pid', attention_cfg=dict(preset='segmenter'))
    pretrained=None,
    data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375]),
    backbone=dict(type='PIDVisionTransformer', attention='pid', attention_cfg=dict(preset='segmenter'), patch_bias=True),
)
# Learnable method parameters (attention_cfg=dict(..., learnable=True): each layer's PID gains; value residual's lambdas) are
# the `attention_params` of each layer: no weight decay for them (decay would pull PID's raw gains to 0, i.e.
# every gain to log 2, and value residual's lambdas to 0), whatever weight_decay the optimizer is given. (Before
# the rename the key was 'pid_gains': WeightsOnlyCheckpointHook stops a run whose custom_keys still names it.)
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={'attention_params': dict(decay_mult=0.0)}))
