"""The reference's numeric primitives (float64 numpy, no state): activations, norms, the
bidirectional conv, NeoX RoPE and the block calibration tau. clover_testkit.reference.model is
the model built from them (its module docstring gives the conventions)."""

from __future__ import annotations

import math

import numpy as np

QK_NORM_EPS = 1e-6


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def rms_norm_1p(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * (1 + w), over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def l2_norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + QK_NORM_EPS)


def block_tau(block_calib: np.ndarray, block_size: int, train_block_size: int) -> np.ndarray:
    """tau_j = exp(theta_j + phi_j * ln(B / B0)); block_calib is [2, Hv] (theta, phi)."""
    theta, phi = block_calib[0], block_calib[1]
    return np.exp(theta + phi * math.log(block_size / train_block_size))


def bidirectional_conv(tail: np.ndarray, u: np.ndarray, w_conv: np.ndarray,
                       w_look: np.ndarray) -> np.ndarray:
    """Pre-activation conv output c [n, C] (apply silu after).

    tail [K-1, C] (committed rows), u [n, C] (this block's rows), w_conv [C, K] (last tap =
    current token), w_look [C, R] (tap j multiplies u[t+1+j], zero past row n-1).
    """
    n, C = u.shape
    K, R = w_conv.shape[1], w_look.shape[1]
    U = np.concatenate([tail, u], axis=0)                     # row t+K-1 is token t
    ahead = np.concatenate([u, np.zeros((R, C))], axis=0)     # zeros past the block end
    c = np.zeros((n, C))
    for j in range(K):                                        # all rows t at once, tap by tap
        c += w_conv[:, j] * U[j:j + n]                        # U[t + j]
    for j in range(R):
        c += w_look[:, j] * ahead[1 + j:1 + j + n]            # ahead[t + 1 + j]
    return c


def rope_neox(x: np.ndarray, positions: np.ndarray, rot: int, theta: float) -> np.ndarray:
    """x [..., n, dh]; rotate the first `rot` dims (rotate_half pairing i, i + rot/2)."""
    if rot == 0:
        return x
    half = rot // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rot)
    ang = positions[:, None].astype(np.float64) * inv_freq[None, :]   # [n, half]
    cos, sin = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:rot]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rot] = x2 * cos + x1 * sin
    return out
