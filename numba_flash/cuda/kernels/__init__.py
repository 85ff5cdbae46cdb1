"""Kernel families: forward (forward_mma, forward_fma, with forward_geometry), decode
(decode_mma, decode_fma, with decode_split), merge, and the device-side mask helpers
(masking, tile_classes). A kernel module builds kernels; it never launches them."""
