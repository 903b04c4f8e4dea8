"""A line-by-line Python transcription of ggml-quants.c's Q2_K / Q3_K / Q4_K / Q5_K / Q6_K quantizers, one block at a
time, in numpy float32 scalars: the slow, obviously-the-C reference that quantkit/gguf/reference_quants.py's
vectorised port is tested against (tests/test_gguf_reference_quants.py). Written from the C, not from the
port: the loops, the order of every fp32 operation, the uint8 / int8 stores and the struct byte layouts
(block_q2_K, block_q3_K, block_q4_K, block_q5_K, block_q6_K) are the C's.
"""

from __future__ import annotations

import numpy as np

f = np.float32
QK_K = 256
GROUP_MAX_EPS = f(1e-15)


def nearest_int(fval) -> int:
    val = np.array([f(f(fval) + f(12582912.0))], np.float32)
    i = int(val.view(np.int32)[0])
    return (i & 0x007FFFFF) - 0x00400000


def fp16(x) -> np.float16:
    return np.float16(f(x))


def u8(i: int) -> int:
    return i & 0xFF


def i8(i: int) -> int:
    return ((i + 128) & 0xFF) - 128


def make_qkx_quants(n, nmax, x, weights, L, Laux, rmin, rdelta, nstep, qkx3, use_mad=False):
    """make_qkx2_quants (qkx3 False) / make_qkx3_quants (weights given). returns (scale, the_min)."""
    mn = x[0]
    mx = x[0]
    sum_w = weights[0]
    sum_x = f(sum_w * x[0])
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        w = weights[i]
        sum_w = f(sum_w + w)
        sum_x = f(sum_x + f(w * x[i]))
    if mn > 0:
        mn = f(0)
    if (mx <= mn) if qkx3 else (mx == mn):
        for i in range(n):
            L[i] = 0
        return f(0), f(-mn)
    iscale = f(f(nmax) / f(mx - mn))
    scale = f(f(1) / iscale)
    best_error = f(0)
    for i in range(n):
        l = nearest_int(f(iscale * f(x[i] - mn)))
        L[i] = max(0, min(nmax, l))
        diff = f(f(f(scale * f(L[i])) + mn) - x[i])
        diff = abs(diff) if use_mad else f(diff * diff)
        best_error = f(best_error + f(weights[i] * diff))
    for is_ in range(nstep + 1):
        iscale = f(f(f(f(rmin) + f(f(rdelta) * f(is_))) + f(nmax)) / f(mx - mn))
        sum_l = sum_l2 = sum_xl = f(0)
        for i in range(n):
            v = f(iscale * f(x[i] - mn))
            if qkx3:
                l = nearest_int(v if v < f(nmax) else f(nmax)) if v > 0 else 0
            else:
                l = max(0, min(nmax, nearest_int(v)))
            Laux[i] = l
            w = weights[i]
            sum_l = f(sum_l + f(w * f(l)))
            sum_l2 = f(sum_l2 + f(f(w * f(l)) * f(l)))
            sum_xl = f(sum_xl + f(f(w * f(l)) * x[i]))
        D = f(f(sum_w * sum_l2) - f(sum_l * sum_l))
        if D > 0:
            this_scale = f(f(f(sum_w * sum_xl) - f(sum_x * sum_l)) / D)
            this_min = f(f(f(sum_l2 * sum_x) - f(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = f(0)
                this_scale = f(sum_xl / sum_l2)
            cur_error = f(0)
            for i in range(n):
                diff = f(f(f(this_scale * f(Laux[i])) + this_min) - x[i])
                diff = abs(diff) if use_mad else f(diff * diff)
                cur_error = f(cur_error + f(weights[i] * diff))
            if cur_error < best_error:
                for i in range(n):
                    L[i] = Laux[i]
                best_error = cur_error
                scale = this_scale
                mn = this_min
    return scale, f(-mn)


def make_qp_quants(n, nmax, x, L, quant_weights):
    mx = f(0)
    for i in range(n):
        mx = mx if mx > x[i] else x[i]
    if mx < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return f(0)
    iscale = f(f(nmax) / mx)
    for i in range(n):
        L[i] = u8(nearest_int(f(iscale * x[i])))
    scale = f(f(1) / iscale)
    best_mse = f(0)
    for i in range(n):
        diff = f(x[i] - f(scale * f(L[i])))
        best_mse = f(best_mse + f(f(quant_weights[i] * diff) * diff))
    for is_ in range(-4, 5):
        if is_ == 0:
            continue
        iscale_is = f(f(f(f(0.1) * f(is_)) + f(nmax)) / mx)
        scale_is = f(f(1) / iscale_is)
        mse = f(0)
        for i in range(n):
            l = min(nmax, nearest_int(f(iscale_is * x[i])))
            diff = f(x[i] - f(scale_is * f(l)))
            mse = f(mse + f(f(quant_weights[i] * diff) * diff))
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_is
    sumlx = suml2 = f(0)
    for i in range(n):
        l = min(nmax, nearest_int(f(iscale * x[i])))
        L[i] = u8(l)
        w = quant_weights[i]
        sumlx = f(sumlx + f(f(w * x[i]) * f(l)))
        suml2 = f(suml2 + f(f(w * f(l)) * f(l)))
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = quant_weights[i]
            slx = f(sumlx - f(f(w * x[i]) * f(L[i])))
            sl2 = f(suml2 - f(f(w * f(L[i])) * f(L[i])))
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(f(f(x[i] * sl2) / slx)))
                if new_l != L[i]:
                    slx = f(slx + f(f(w * x[i]) * f(new_l)))
                    sl2 = f(sl2 + f(f(w * f(new_l)) * f(new_l)))
                    if f(f(slx * slx) * suml2) > f(f(sumlx * sumlx) * sl2):
                        L[i] = u8(new_l)
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if not n_changed:
            break
    return f(sumlx / suml2) if suml2 > 0 else f(0)


def make_qx_quants(n, nmax, x, L, qw):
    """rmse_type 1."""
    mx = amax = f(0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return f(0)
    iscale = f(f(-nmax) / mx)
    sumlx = suml2 = f(0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(f(iscale * x[i]))))
        L[i] = l + nmax
        w = qw[i] if qw is not None else f(x[i] * x[i])
        sumlx = f(sumlx + f(f(w * x[i]) * f(l)))
        suml2 = f(suml2 + f(f(w * f(l)) * f(l)))
    scale = f(sumlx / suml2) if suml2 else f(0)
    best = f(scale * sumlx)
    for is_ in range(-9, 10):
        if is_ == 0:
            continue
        iscale = f(-f(f(nmax) + f(f(0.1) * f(is_))) / mx)
        sumlx = suml2 = f(0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nearest_int(f(iscale * x[i]))))
            w = qw[i] if qw is not None else f(x[i] * x[i])
            sumlx = f(sumlx + f(f(w * x[i]) * f(l)))
            suml2 = f(suml2 + f(f(w * f(l)) * f(l)))
        if suml2 > 0 and f(sumlx * sumlx) > f(best * suml2):
            for i in range(n):
                l = nearest_int(f(iscale * x[i]))
                L[i] = nmax + max(-nmax, min(nmax - 1, l))
            scale = f(sumlx / suml2)
            best = f(scale * sumlx)
    return scale


def _scales_k4(ls, lm) -> list[int]:
    s = [0] * 12
    for j in range(8):
        if j < 4:
            s[j] = u8(ls[j])
            s[j + 4] = u8(lm[j])
        else:
            s[j + 4] = u8((ls[j] & 0xF) | ((lm[j] & 0xF) << 4))
            s[j - 4] = u8(s[j - 4] | ((ls[j] >> 4) << 6))
            s[j - 0] = u8(s[j - 0] | ((lm[j] >> 4) << 6))
    return s


def get_scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4)


def quantize_block_q45_k(x, nmax: int, qw=None) -> bytes:
    """quantize_row_q4_K_ref / _q5_K_ref (qw None) or _impl of one super-block x [256] -> its 144 / 176 bytes."""
    x = [f(v) for v in x]
    L, Laux, weights = [0] * QK_K, [0] * 32, [f(0)] * 32
    scales, mins = [f(0)] * 8, [f(0)] * 8
    if qw is None:
        rmin, rdelta, nstep = (-1.0, 0.1, 20) if nmax == 15 else (-0.5, 0.1, 15)
        max_scale = max_min = f(0)
        for j in range(8):
            sum_x2 = f(0)
            for l in range(32):
                sum_x2 = f(sum_x2 + f(x[32 * j + l] * x[32 * j + l]))
            av_x = np.sqrt(f(sum_x2 / f(32)))
            for l in range(32):
                weights[l] = f(av_x + abs(x[32 * j + l]))
            sub = L[32 * j:32 * j + 32]
            scales[j], mins[j] = make_qkx_quants(32, nmax, x[32 * j:32 * j + 32], weights, sub, Laux, rmin, rdelta,
                                                 nstep, False)
            L[32 * j:32 * j + 32] = sub
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        inv_scale = f(f(63) / max_scale) if max_scale > 0 else f(0)
        inv_min = f(f(63) / max_min) if max_min > 0 else f(0)
        ls = [min(63, u8(nearest_int(f(inv_scale * scales[j])))) for j in range(8)]
        lm = [min(63, u8(nearest_int(f(inv_min * mins[j])))) for j in range(8)]
        d, dmin = fp16(f(max_scale / f(63))), fp16(f(max_min / f(63)))
    else:
        qw = [f(v) for v in qw]
        sum_x2 = f(0)
        for l in range(QK_K):
            sum_x2 = f(sum_x2 + f(x[l] * x[l]))
        sigma2 = f(f(f(2) * sum_x2) / f(QK_K))
        sw = [f(0)] * 8
        for j in range(8):
            for l in range(32):
                weights[l] = f(qw[32 * j + l] * np.sqrt(f(sigma2 + f(x[32 * j + l] * x[32 * j + l]))))
            sumw = f(0)
            for l in range(32):
                sumw = f(sumw + weights[l])
            sw[j] = sumw
            sub = L[32 * j:32 * j + 32]
            scales[j], mins[j] = make_qkx_quants(32, nmax, x[32 * j:32 * j + 32], weights, sub, Laux, -0.9, 0.05, 36,
                                                 True)
            L[32 * j:32 * j + 32] = sub
        Ls, Lm = [0] * 8, [0] * 8
        d_block = make_qp_quants(8, 63, scales, Ls, sw)
        m_block = make_qp_quants(8, 63, mins, Lm, sw)
        ls, lm = (Ls, Lm) if nmax == 15 else ([min(63, v) for v in Ls], [min(63, v) for v in Lm])
        d, dmin = fp16(d_block), fp16(m_block)
    sc_bytes = _scales_k4(ls, lm)
    for j in range(8):
        sc, m = get_scale_min_k4(j, sc_bytes)
        dd = f(f(d) * f(sc))
        if not dd:
            continue
        dm = f(f(dmin) * f(m))
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int(f(f(x[32 * j + ii] + dm) / dd))))
    head = np.array([d, dmin], np.float16).tobytes() + bytes(sc_bytes)
    if nmax == 15:
        q = []
        for j in range(0, QK_K, 64):
            q += [L[j + l] | (L[j + l + 32] << 4) for l in range(32)]
        return head + bytes(q)
    qh, ql = [0] * 32, []
    m1, m2 = 1, 2
    for n in range(0, QK_K, 64):
        for j in range(32):
            l1, l2 = L[n + j], L[n + j + 32]
            if l1 > 15:
                l1 -= 16
                qh[j] |= m1
            if l2 > 15:
                l2 -= 16
                qh[j] |= m2
            ql.append(l1 | (l2 << 4))
        m1 <<= 2
        m2 <<= 2
    return head + bytes(qh) + bytes(ql)


def quantize_block_q6_k(x, qw=None) -> bytes:
    """quantize_row_q6_K_ref (qw None) or _impl of one super-block x [256] -> its 210 bytes."""
    x = [f(v) for v in x]
    L = [0] * QK_K
    scales = [f(0)] * 16
    max_scale = max_abs_scale = f(0)
    for ib in range(16):
        sub = L[16 * ib:16 * ib + 16]
        scale = make_qx_quants(16, 32, x[16 * ib:16 * ib + 16], sub,
                               None if qw is None else [f(v) for v in qw[16 * ib:16 * ib + 16]])
        L[16 * ib:16 * ib + 16] = sub
        scales[ib] = scale
        if abs(scale) > max_abs_scale:
            max_abs_scale = abs(scale)
            max_scale = scale
    if max_abs_scale < GROUP_MAX_EPS:
        return bytes(210)
    iscale = f(f(-128) / max_scale)
    d = fp16(f(f(1) / iscale))
    sc = [i8(min(127, nearest_int(f(iscale * scales[ib])))) for ib in range(16)]
    for j in range(16):
        dd = f(f(d) * f(sc[j]))
        if not dd:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, nearest_int(f(x[16 * j + ii] / dd)))) + 32
    ql, qh = [0] * 128, [0] * 64
    for h, j in enumerate(range(0, QK_K, 128)):
        for l in range(32):
            q1, q2, q3, q4 = (L[j + l + o] & 0xF for o in (0, 32, 64, 96))
            ql[64 * h + l] = q1 | (q3 << 4)
            ql[64 * h + l + 32] = q2 | (q4 << 4)
            qh[32 * h + l] = ((L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4)
                              | ((L[j + l + 96] >> 4) << 6))
    return bytes(ql) + bytes(qh) + np.array(sc, np.int8).tobytes() + np.array([d], np.float16).tobytes()


def make_q3_quants(n, nmax, x, L):
    """do_rmse true."""
    mx = amax = f(0)
    for i in range(n):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            mx = x[i]
    if amax < GROUP_MAX_EPS:
        for i in range(n):
            L[i] = 0
        return f(0)
    iscale = f(f(-nmax) / mx)
    sumlx = suml2 = f(0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nearest_int(f(iscale * x[i]))))
        L[i] = l
        w = f(x[i] * x[i])
        sumlx = f(sumlx + f(f(w * x[i]) * f(l)))
        suml2 = f(suml2 + f(f(w * f(l)) * f(l)))
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = f(x[i] * x[i])
            slx = f(sumlx - f(f(w * x[i]) * f(L[i])))
            if slx > 0:
                sl2 = f(suml2 - f(f(w * f(L[i])) * f(L[i])))
                new_l = max(-nmax, min(nmax - 1, nearest_int(f(f(x[i] * sl2) / slx))))
                if new_l != L[i]:
                    slx = f(slx + f(f(w * x[i]) * f(new_l)))
                    sl2 = f(sl2 + f(f(w * f(new_l)) * f(new_l)))
                    if sl2 > 0 and f(f(slx * slx) * suml2) > f(f(sumlx * sumlx) * sl2):
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if not n_changed:
            break
    for i in range(n):
        L[i] += nmax
    return f(sumlx / suml2) if suml2 > 0 else f(0)


def _qs_2bit(L) -> bytes:
    q = [0] * 64
    for j in range(0, QK_K, 128):
        for l in range(32):
            q[j // 4 + l] = L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6)
    return bytes(q)


def quantize_block_q3_k(x, qw=None) -> bytes:
    """quantize_row_q3_K_ref (qw None) or _impl of one super-block x [256] -> its 110 bytes."""
    x = [f(v) for v in x]
    L = [0] * QK_K
    scales = [f(0)] * 16
    sc_bytes = [0] * 12
    if qw is None:
        max_scale = amax = f(0)
        for j in range(16):
            sub = L[16 * j:16 * j + 16]
            scales[j] = make_q3_quants(16, 4, x[16 * j:16 * j + 16], sub)
            L[16 * j:16 * j + 16] = sub
            scale = abs(scales[j])
            if scale > amax:
                amax = scale
                max_scale = scales[j]
        if max_scale:
            iscale = f(f(-32) / max_scale)
            for j in range(16):
                l = i8(nearest_int(f(iscale * scales[j])))
                l = max(-32, min(31, l)) + 32
                if j < 8:
                    sc_bytes[j] = l & 0xF
                else:
                    sc_bytes[j - 8] |= (l & 0xF) << 4
                l >>= 4
                sc_bytes[j % 4 + 8] |= l << (2 * (j // 4))
            d = fp16(f(f(1) / iscale))
        else:
            d = fp16(0)
    else:
        qw = [f(v) for v in qw]
        sumx2 = f(0)
        for j in range(QK_K):
            sumx2 = f(sumx2 + f(x[j] * x[j]))
        sigma2 = f(f(f(2) * sumx2) / f(QK_K))
        sw = [f(0)] * 16
        for j in range(16):
            weight = [f(qw[16 * j + l] * np.sqrt(f(sigma2 + f(x[16 * j + l] * x[16 * j + l])))) for l in range(16)]
            sumw = f(0)
            for l in range(16):
                sumw = f(sumw + weight[l])
            sw[j] = sumw
            sub = L[16 * j:16 * j + 16]
            scales[j] = make_qx_quants(16, 4, x[16 * j:16 * j + 16], sub, weight)
            L[16 * j:16 * j + 16] = sub
        Ls = [0] * 16
        d_block = make_qx_quants(16, 32, scales, Ls, sw)
        for j in range(16):
            l = Ls[j]
            if j < 8:
                sc_bytes[j] = l & 0xF
            else:
                sc_bytes[j - 8] |= (l & 0xF) << 4
            l >>= 4
            sc_bytes[j % 4 + 8] |= l << (2 * (j // 4))
        d = fp16(d_block)
    for j in range(16):
        sc = sc_bytes[j] & 0xF if j < 8 else sc_bytes[j - 8] >> 4
        sc = (sc | (((sc_bytes[8 + j % 4] >> (2 * (j // 4))) & 3) << 4)) - 32
        dd = f(f(d) * f(sc))
        if not dd:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-4, min(3, nearest_int(f(x[16 * j + ii] / dd)))) + 4
    hmask = [0] * 32
    m, hm = 0, 1
    for j in range(QK_K):
        if L[j] > 3:
            hmask[m] |= hm
            L[j] -= 4
        m += 1
        if m == QK_K // 8:
            m, hm = 0, hm << 1
    return bytes(hmask) + _qs_2bit(L) + bytes(sc_bytes) + np.array([d], np.float16).tobytes()


def quantize_block_q2_k(x, qw=None) -> bytes:
    """quantize_row_q2_K_ref (qw None) or _impl of one super-block x [256] -> its 84 bytes."""
    x = [f(v) for v in x]
    L, Laux = [0] * QK_K, [0] * 16
    scales, mins = [f(0)] * 16, [f(0)] * 16
    sc_bytes = [0] * 16
    if qw is None:
        max_scale = max_min = f(0)
        for j in range(16):
            weights = [abs(x[16 * j + l]) for l in range(16)]
            sub = L[16 * j:16 * j + 16]
            scales[j], mins[j] = make_qkx_quants(16, 3, x[16 * j:16 * j + 16], weights, sub, Laux, -0.5, 0.1, 15,
                                                 False, use_mad=True)
            L[16 * j:16 * j + 16] = sub
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        if max_scale > 0:
            iscale = f(f(15) / max_scale)
            for j in range(16):
                sc_bytes[j] = u8(nearest_int(f(iscale * scales[j])))
            d = fp16(f(max_scale / f(15)))
        else:
            d = fp16(0)
        if max_min > 0:
            iscale = f(f(15) / max_min)
            for j in range(16):
                sc_bytes[j] = u8(sc_bytes[j] | (nearest_int(f(iscale * mins[j])) << 4))
            dmin = fp16(f(max_min / f(15)))
        else:
            dmin = fp16(0)
    else:
        qw = [f(v) for v in qw]
        sumx2 = f(0)
        for j in range(QK_K):
            sumx2 = f(sumx2 + f(x[j] * x[j]))
        sigma2 = f(sumx2 / f(QK_K))
        sw = [f(0)] * 16
        for j in range(16):
            weight = [f(qw[16 * j + l] * np.sqrt(f(sigma2 + f(x[16 * j + l] * x[16 * j + l])))) for l in range(16)]
            for l in range(16):
                sw[j] = f(sw[j] + weight[l])
            sub = L[16 * j:16 * j + 16]
            scales[j], mins[j] = make_qkx_quants(16, 3, x[16 * j:16 * j + 16], weight, sub, Laux, -0.9, 0.05, 36,
                                                 True)
            L[16 * j:16 * j + 16] = sub
        Ls, Lm = [0] * 16, [0] * 16
        dm = make_qp_quants(16, 15, scales, Ls, sw)
        mm = make_qp_quants(16, 15, mins, Lm, sw)
        d, dmin = fp16(dm), fp16(mm)
        for j in range(16):
            sc_bytes[j] = u8(Ls[j] | (Lm[j] << 4))
    for j in range(16):
        dd = f(f(d) * f(sc_bytes[j] & 0xF))
        if not dd:
            continue
        dm = f(f(dmin) * f(sc_bytes[j] >> 4))
        for ii in range(16):
            L[16 * j + ii] = max(0, min(3, nearest_int(f(f(x[16 * j + ii] + dm) / dd))))
    return bytes(sc_bytes) + _qs_2bit(L) + np.array([d, dmin], np.float16).tobytes()


def quantize(kind: str, w: np.ndarray, importance: np.ndarray | None = None) -> np.ndarray:
    """ggml_quantize_chunk of w float32 [N, K] -> uint8 [N, K/256*bytes], block by block (fp32 overflow to
    inf and the NaN that follows are the C's too: numpy's warnings about them are silenced)."""
    with np.errstate(all="ignore"):
        return _quantize(kind, w, importance)


def _quantize(kind: str, w: np.ndarray, importance: np.ndarray | None) -> np.ndarray:
    rows = []
    for row in np.asarray(w, np.float32):
        out = b""
        for i in range(0, row.shape[0], QK_K):
            qw = None if importance is None else np.asarray(importance, np.float32)[i:i + QK_K]
            if kind == "Q6_K":
                out += quantize_block_q6_k(row[i:i + QK_K], qw)
            elif kind == "Q3_K":
                out += quantize_block_q3_k(row[i:i + QK_K], qw)
            elif kind == "Q2_K":
                out += quantize_block_q2_k(row[i:i + QK_K], qw)
            else:
                out += quantize_block_q45_k(row[i:i + QK_K], 15 if kind == "Q4_K" else 31, qw)
        rows.append(np.frombuffer(out, np.uint8))
    return np.stack(rows)
