# Segmenter with a PID DeiT-small backbone (ADE20K), preset `segmenter`.
_base_ = 'mmseg::segmenter/segmenter_vit-s_mask_8xb1-160k_ade20k-512x512.py'
custom_imports = dict(imports=['pid_plugins.mmseg'], allow_failed_imports=False)
model = dict(pretrained=None, backbone=dict(type='PIDVisionTransformer', attention='pid', pid=dict(preset='segmenter')))
