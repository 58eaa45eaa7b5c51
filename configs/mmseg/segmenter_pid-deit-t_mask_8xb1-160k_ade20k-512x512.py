# Segmenter (mask transformer) with a PID DeiT-tiny backbone on ADE20K: PIDformer's segmentation setting.
# mmseg's own config, with the backbone switched to PID (paper preset `segmenter`: 0.5, 0.3, 0.05, 1.0).
_base_ = 'mmseg::segmenter/segmenter_vit-t_mask_8xb1-160k_ade20k-512x512.py'
custom_imports = dict(imports=['pid_plugins.mmseg'], allow_failed_imports=False)

model = dict(
    # mmseg's config points `pretrained` at a download; nothing is fetched here. To start from ImageNet
    # weights set backbone.init_cfg=dict(type='Pretrained', checkpoint='/path/to/deit_tiny.pth'): a timm
    # DeiT/ViT checkpoint (softmax or PID) or an mmseg ViT checkpoint of the same size.
    pretrained=None,
    backbone=dict(type='PIDVisionTransformer', attention='pid', pid=dict(preset='segmenter')),
)
