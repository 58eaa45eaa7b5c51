# Segmenter with a PID DeiT-small backbone (ADE20K), preset `segmenter`; initialised like the -t- config
# (timm DeiT checkpoint: patch-embedding bias, ImageNet mean/std).
_base_ = 'mmseg::segmenter/segmenter_vit-s_mask_8xb1-160k_ade20k-512x512.py'
custom_imports = dict(imports=['pid_plugins.mmseg'], allow_failed_imports=False)
# load_from / resume / tools/test.py load weights only, whatever TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD says
custom_hooks = [dict(type='WeightsOnlyCheckpointHook')]
model = dict(
    pretrained=None,
    data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375]),
    backbone=dict(type='PIDVisionTransformer', attention='pid', attention_cfg=dict(preset='segmenter'), patch_bias=True),
)
# Learnable method parameters (attention_cfg=dict(..., learnable=True): each layer's PID gains; value residual's lambdas) are
# the `attention_params` of each layer: no weight decay for them (decay would pull PID's raw gains to 0, i.e.
# every gain to log 2, and value residual's lambdas to 0), whatever weight_decay the optimizer is given. (Before
# the rename the key was 'pid_gains': WeightsOnlyCheckpointHook stops a run whose custom_keys still names it.)
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={'attention_params': dict(decay_mult=0.0)}))
