import torch, torch.nn.functional as F
x = torch.randn(4, 8, device="cuda", dtype=torch.bfloat16); w = torch.randn(8, device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    print("cuda autocast F.rms_norm(bf16 x, f32 w):", F.rms_norm(x, (8,), w).dtype)
    print("cuda autocast F.rms_norm(f32 x, f32 w):", F.rms_norm(x.float(), (8,), w).dtype)
    print("cuda autocast F.layer_norm(bf16 x, f32 w):", F.layer_norm(x, (8,), w, w).dtype)
print("eager F.layer_norm(bf16 x, f32 w):", F.layer_norm(x, (8,), w, w).dtype)
