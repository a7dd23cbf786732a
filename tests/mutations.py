"""The named mutations `python -m tests.mutation_check` applies, one at a time, to a scratch copy of the repo.

Each mutation is a small, realistic bug against one promise of the README: the file, the exact original
snippet(s) (each must occur exactly once, or the mutation is stale and reported as such), the
replacement, and the fast tests expected to kill it (pytest arguments: node ids, or a file with -k).
`wider` names a larger selection (`--wider`). A mutation no listed test kills is a missing test.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    promise: str  # the README promise it attacks
    file: str  # relative to the repo root
    edits: tuple[tuple[str, str], ...]  # (exact original snippet, replacement), applied in order
    tests: tuple[str, ...]  # pytest arguments of the fast tests expected to kill it
    wider: tuple[str, ...] = ()  # extra pytest arguments for --wider


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "lazy_head_computes_every_row",
        "the device loop's lazy verify head computes the LM head of the walked rows only",
        "sharpi_jax/runtime/strategies/chain.py",
        (("                               (n_draft + 1) * live, head=e.head_row is None)\n",
          "                               (n_draft + 1) * live, head=True)  # MUTATION: the full head as well\n"),),
        ("tests/runtime/test_device_loop.py::test_lazy_verify_head_computes_one_head_row_at_a_time",),
    ),
    Mutation(
        "lazy_head_seeded_draw_index",
        "device loop == host loop (seeded): a walked row's token is drawn with its own generated index",
        "sharpi_jax/runtime/strategies/chain.py",
        (("            lambda r: e.head_row(e.params, cache, hidden, r), lambda logits_r, r: pick(logits_r, index + r + 1),\n",
          "            lambda r: e.head_row(e.params, cache, hidden, r), lambda logits_r, r: pick(logits_r, index + r),\n"),),
        ("tests/runtime/test_device_loop.py::test_greedy_and_seeded_equal_host_loop",),
    ),
    Mutation(
        "lazy_head_tree_walks_any_row",
        "device loop == host loop (tree): the walk (lazy or full) moves to a child of the walked node only",
        "sharpi_jax/runtime/tree_device.py",
        (("    m = (jnp.arange(tokens.shape[0], dtype=jnp.int32) < n) & (parent == r) & (tokens == token)\n",
          "    rows = jnp.arange(tokens.shape[0], dtype=jnp.int32)  # MUTATION: any later row holding the token\n"
          "    m = (rows < n) & (rows > r) & (tokens == token)\n"),),
        ("tests/runtime/test_device_loop.py::test_greedy_and_seeded_equal_host_loop",),
    ),
    Mutation(
        "batch_matmul_rows_misplaced",
        "generate_batch: one ggml call over every sequence's valid rows, each sequence bitwise its own run",
        "csrc/ggml_ops.cc",
        (("    op[m] = y + row(m) * n_rows;\n",
          "    op[m] = y + m * n_rows;  // MUTATION: a batch's rows written in computed order, not where they sit\n"),),
        ("tests/runtime/test_batch.py::test_batched_matmul_is_one_call_of_the_valid_rows",),
        ("tests/runtime/test_batch.py",),
    ),
    Mutation(
        "batch_stopped_sequence_not_held",
        "generate_batch: a sequence that stops (EOS mid-batch) keeps its tokens while the others go on",
        "sharpi_jax/runtime/device_loop.py",
        (("        return {k: v if k in _STALE_OK else jax.tree.map(hold, v, c[k]) for k, v in new.items()}\n",
          "        return {k: v if k in _STALE_OK or k == \"i\" else jax.tree.map(hold, v, c[k])  # MUTATION\n"
          "                for k, v in new.items()}\n"),),
        ("tests/runtime/test_batch.py", "-k", "test_batch_of_three_equals_alone_with_eos_mid_batch and greedy-plain"),
    ),
    Mutation(
        "batch_stopped_sequence_keeps_its_rows",
        "generate_batch: a stopped sequence's rows are padding that reads no expert",
        "sharpi_jax/model/moe.py",
        (("    return jnp.where(valid[..., None], sel, first), True\n",
          "    return jnp.where(valid[..., None], sel, sel[:, :1]), True  # MUTATION: its own row 0's experts\n"),),
        ("tests/runtime/test_batch.py::test_padding_route_batched",),
    ),
    Mutation(
        "batch_stopped_tree_keeps_its_trunk_rows",
        "generate_batch: a stopped sequence's rows are padding that reads no expert (the tree's trunk pass)",
        "sharpi_jax/runtime/strategies/tree.py",
        (("                                    c[\"path\"], c[\"n_path\"], tt, P, n * live, tdepth, tparent, anc,\n",
          "                                    c[\"path\"], c[\"n_path\"], tt, P, n, tdepth, tparent, anc,  # MUTATION\n"),),
        ("tests/runtime/test_batch.py::test_stopped_tree_sequence_computes_no_rows",),
    ),
    Mutation(
        "batch_stopped_tree_still_drafts",
        "generate_batch: a stopped sequence's rows are padding that reads no expert (the tree's MTP head)",
        "sharpi_jax/runtime/tree_device.py",
        (("    idx, lp, prev_hp, cache, h_t = root(params, cache, tokens, h_prev, hidden, start, n_valid, c, live)\n"
          "    depth, n_nodes = depth * live, n_nodes * live\n",
          "    idx, lp, prev_hp, cache, h_t = root(params, cache, tokens, h_prev, hidden, start, n_valid, c)  # MUTATION\n"),),
        ("tests/runtime/test_batch.py::test_stopped_tree_sequence_computes_no_rows",),
    ),
    Mutation(
        "batch_shared_seed",
        "generate_batch: each sequence samples with its own seed",
        "sharpi_jax/runtime/batch.py",
        (("    rows = [traced_params(dataclasses.replace(sampling, seed=int(s))) for s in seeds]\n",
          "    rows = [traced_params(sampling) for s in seeds]  # MUTATION: one seed for all\n"),),
        ("tests/runtime/test_batch.py", "-k", "test_engine_generate_batch"),
    ),
    Mutation(
        "generate_batch_takes_the_host_loop",
        "generate_batch: what one device loop cannot run is refused in one line",
        "sharpi_jax/api.py",
        (("        if not opts.device_loop:\n", "        if False:  # MUTATION: host loop / sequential verify silently batched\n"),),
        ("tests/runtime/test_batch.py::test_refused_options_one_line",),
    ),
    Mutation(
        "sweep_batch_records_misassigned",
        "batched sweeps: each record holds its own prompt's figures",
        "experiments/sweep.py",
        (("for (_, point, group), runs in zip(cells, results) for j, pi in enumerate(group)]",
          "for (_, point, group), runs in zip(cells, results) for j, pi in enumerate(group[::-1])]  # MUTATION"),),
        ("tests/experiments/test_sweep_plot.py::test_batched_sweep_records_each_prompt_as_generated_alone",),
    ),
    Mutation(
        "grouped_generate_out_of_order",
        "batched sweeps: generate_grouped returns each prompt's own output, in order",
        "experiments/batches.py",
        (("        out += engine.generate_batch([prompts[i] for i in g], **options)\n",
          "        out += engine.generate_batch([prompts[i] for i in g][::-1], **options)  # MUTATION\n"),),
        ("tests/experiments/test_sweep_plot.py::test_batched_sweep_records_each_prompt_as_generated_alone",),
    ),
    Mutation(
        "session_kept_state_off_bucket_boundary",
        "sessions: a turn equals a fresh generate over the whole conversation, bit for bit",
        "sharpi_jax/runtime/session.py",
        (("        cut = n0 + L * ((len(ids) - n0 - 1) // L)",
          "        cut = n0 + (L // 2) * ((len(ids) - n0 - 1) // (L // 2))  # MUTATION: half-bucket boundaries"),),
        ("tests/runtime/test_session.py", "-k", "test_continued_prefill_is_bitwise_one_prefill"),
    ),
    Mutation(
        "decode_step_keeps_the_state_before_the_row",
        "decode steps (the GDN loop without snapshots) equal a verify pass row by row, state included",
        "sharpi_jax/model/gated_delta_net.py",
        (("            conv, S, o = jax.lax.fori_loop(0, n, step, (conv_state, ssm_state, o))\n",
          "            _, _, o = jax.lax.fori_loop(0, n, step, (conv_state, ssm_state, o))  # MUTATION: state not advanced\n"
          "            conv, S = conv_state, ssm_state\n"),),
        ("tests/runtime/test_speculative.py", "-k", "test_batched_verify_bitwise_equals_sequential"),
    ),
    Mutation(
        "verify_pass_fresh_snapshot_buffers",
        "a verify pass writes its GDN snapshots into the previous pass's buffers (no per-pass allocation)",
        "sharpi_jax/runtime/steps.py",
        (("        logits, hidden, state, snaps = model.rows(commit(state, snaps, index), tokens, pos, n_valid, into=snaps,\n",
          "        logits, hidden, state, snaps = model.rows(commit(state, snaps, index), tokens, pos, n_valid,  # MUTATION\n"),),
        ("tests/runtime/test_steps.py", "-k", "test_verify_pass_copies_no_gdn_state"),
    ),
    Mutation(
        "tree_pass_fresh_snapshot_buffers",
        "a verify pass writes its GDN snapshots into the previous pass's buffers (no per-pass allocation)",
        "sharpi_jax/runtime/steps.py",
        (("        logits, hidden, state, snaps = model.rows(state, tokens, pos, n_valid, tree, into=snaps, head=head)\n",
          "        logits, hidden, state, snaps = model.rows(state, tokens, pos, n_valid, tree, head=head)  # MUTATION\n"),),
        ("tests/runtime/test_steps.py", "-k", "test_verify_pass_copies_no_gdn_state"),
    ),
    Mutation(
        "commit_state_fresh_buffers",
        "a verify pass writes the committed GDN state into the state's own buffers",
        "sharpi_jax/runtime/steps.py",
        (("        commit_verify=(commit_verify, dict(donate_argnums=(1, 2, 3), keep_unused=True, static_argnames=(\"head\",))),\n",
          "        commit_verify=(commit_verify, dict(donate_argnums=(1, 2, 3), static_argnames=(\"head\",))),  # MUTATION\n"),),
        ("tests/runtime/test_steps.py", "-k", "test_commit_verify_writes_into_the_donated_snapshots"),
    ),
    Mutation(
        "verify_loop_carries_the_state",
        "a verify pass's GDN loop carries the snapshots only (no per-layer copy of the state per pass)",
        "sharpi_jax/model/gated_delta_net.py",
        (("            o, (conv_snaps, ssm_snaps) = carry\n"
          "            p = t - 1 if parent is None else at(parent, t)\n"
          "            i = jnp.maximum(p, 0)\n"
          "            conv = jnp.where(p < 0, conv_state, at(conv_snaps, i))\n"
          "            S = jnp.where(p < 0, ssm_state, at(ssm_snaps, i))\n"
          "            conv, S, o = step(t, (conv, S, o))\n"
          "            return o, (put(conv_snaps, conv, t), put(ssm_snaps, S, t))\n",
          "            conv, S, o, (conv_snaps, ssm_snaps) = carry  # MUTATION: a chain carries the state\n"
          "            if parent is not None:\n"
          "                p = at(parent, t)\n"
          "                i = jnp.maximum(p, 0)\n"
          "                conv = jnp.where(p < 0, conv_state, at(conv_snaps, i))\n"
          "                S = jnp.where(p < 0, ssm_state, at(ssm_snaps, i))\n"
          "            conv, S, o = step(t, (conv, S, o))\n"
          "            return conv, S, o, (put(conv_snaps, conv, t), put(ssm_snaps, S, t))\n"),
         ("        o, (conv_snaps, ssm_snaps) = jax.lax.fori_loop(0, n, body, (o, snaps))\n",
          "        _, _, o, (conv_snaps, ssm_snaps) = jax.lax.fori_loop(0, n, body, (conv_state, ssm_state, o, snaps))\n"),),
        ("tests/runtime/test_steps.py", "-k", "test_verify_pass_copies_no_gdn_state"),
    ),
    Mutation(
        "verify_row0_reads_the_stale_snapshot",
        "batched verify == sequential: a pass's first row starts from the committed state, never a stale buffer",
        "sharpi_jax/model/gated_delta_net.py",
        (("            conv = jnp.where(p < 0, conv_state, at(conv_snaps, i))\n",
          "            conv = at(conv_snaps, i)  # MUTATION: the buffer's old contents for row 0\n"),),
        ("tests/runtime/test_steps.py", "-k", "test_commit_verify_writes_into_the_donated_snapshots"),
    ),
    Mutation(
        "session_mtp_rows_shifted",
        "sessions: the MTP head's KV is kept in step (MTP turns equal fresh ones)",
        "sharpi_jax/runtime/mtp.py",
        (("        pos0 = start - (1 if start > 0 and not zero_h_first else 0)\n",
          "        pos0 = start  # MUTATION: continued MTP rows one position late\n"),),
        ("tests/runtime/test_session.py", "-k", "test_continued_prefill_is_bitwise_one_prefill"),
    ),
    Mutation(
        "draft_p_min_device_verifies_uncut_chain",
        "draft_p_min: a pass verifies only the drafts made; device loop == host loop pass for pass",
        "sharpi_jax/runtime/strategies/chain.py",
        (("    n_draft = jnp.minimum(n_draft, n_made)  # draft_p_min may stop the chain early\n",
          "    del n_made  # MUTATION: the cut chain verified at full length\n"),),
        ("tests/runtime/test_draft_p_min.py::test_lossless_and_loops_agree",),
    ),
    Mutation(
        "draft_p_min_keeps_low_probability_draft",
        "draft_p_min: drafting stops before the first draft below p_min",
        "sharpi_jax/runtime/mtp.py",
        (("            return tok, p_top >= p_min\n",
          "            return tok, p_top >= p_min / 2  # MUTATION: a looser threshold\n"),),
        ("tests/runtime/test_draft_p_min.py::test_first_draft_against_the_heads_probability",),
    ),
    Mutation(
        "multirow_wrong_subblock_scale",
        "ggml backend: multi-row K-quant products give ggml's vec_dot bits",
        "csrc/multirow.cc",
        (("  for (int c = 0; c < 8; ++c) b.sc[c] = spread16(scales, c);\n",
          "  for (int c = 0; c < 8; ++c) b.sc[c] = spread16(scales, c == 5 ? 4 : c);  // MUTATION: sub-block 5\n"),),
        ("tests/quant/test_multirow.py", "-k", "test_matmul_is_ggml_bitwise_at_every_width"),
    ),
    Mutation(
        "multirow_neighbour_row",
        "ggml backend: a row's bits depend only on its own activation row (row-stable)",
        "csrc/multirow.cc",
        (("        rs.out[r0 + r][n] = hsum8(acc[r]) + tail;\n",
          "        rs.out[r0 + r][n] = hsum8(acc[r == nr - 1 && r > 0 ? r - 1 : r]) + tail;  // MUTATION\n"),),
        ("tests/quant/test_multirow.py", "-k", "test_matmul_is_ggml_bitwise_at_every_width"),
    ),
    Mutation(
        "multirow_partial_row_block_skipped",
        "ggml backend: multi-row K-quant products give ggml's vec_dot bits",
        "csrc/multirow.cc",
        (("      for (int64_t r = 0; r < kRowBlock; ++r) acc[r] = _mm256_setzero_ps();\n"
          "      for (int64_t i = 0; i < nb; ++i) {\n        const uint8_t* blk = wr + i * kQ6K;\n",
          "      if (nr < kRowBlock) continue;  // MUTATION: the last partial block of rows skipped\n"
          "      for (int64_t r = 0; r < kRowBlock; ++r) acc[r] = _mm256_setzero_ps();\n"
          "      for (int64_t i = 0; i < nb; ++i) {\n        const uint8_t* blk = wr + i * kQ6K;\n"),),
        ("tests/quant/test_multirow.py", "-k", "test_matmul_is_ggml_bitwise_at_every_width"),
    ),
    Mutation(
        "snapkv_rope_slot",
        "SnapKV: RoPE and masks use logical positions on a compacted cache",
        "sharpi_jax/model/attention.py",
        (("        q = rope_neox(self.q_norm(q), positions, self.n_rot, self.rope_base, self.rope_freq_scale)\n"
          "        k = rope_neox(self.k_norm(k), positions, self.n_rot, self.rope_base, self.rope_freq_scale)\n",
          "        rp = positions if shift is None else positions - shift  # MUTATION: the slot, not the position\n"
          "        q = rope_neox(self.q_norm(q), rp, self.n_rot, self.rope_base, self.rope_freq_scale)\n"
          "        k = rope_neox(self.k_norm(k), rp, self.n_rot, self.rope_base, self.rope_freq_scale)\n"),),
        ("tests/runtime/test_snapkv.py::test_evicted_decode_equals_masked_full_cache",),
        ("tests/runtime/test_snapkv.py",),
    ),
    Mutation(
        "snapkv_raw_queries",
        "SnapKV scores the window's post-q-norm, post-RoPE queries",
        "sharpi_jax/model/attention.py",
        (("return (out, cache_k, cache_v, q) if with_q else",
          "return (out, cache_k, cache_v, qg[:, :, 0]) if with_q else"),),
        ("tests/runtime/test_snapkv.py::test_scoring_uses_queries_recomputed_from_the_weights",),
        ("tests/runtime/test_snapkv.py",),
    ),
    Mutation(
        "snapkv_mtp_cache_oversized",
        "SnapKV memory: every attention cache, the MTP block's too, holds kv_budget + max_new_tokens slots",
        "sharpi_jax/runtime/kv_eviction.py",
        (("(cache,) = compact_all([cache], qs, n_rows, kv, capacity)",
          "(cache,) = compact_all([cache], qs, n_rows, kv, capacity + 16)  # MUTATION: an oversized MTP cache"),),
        ("tests/runtime/test_snapkv.py::test_kept_positions_equal_numpy_reference[tiny-qwen35moe]",),
        ("tests/runtime/test_snapkv.py",),
    ),
    Mutation(
        "tree_chain_only",
        "the tree is the greedy chain plus the best other candidates by cumulative log-prob",
        "sharpi_jax/runtime/tree_draft.py",
        (("        keep += others[:max(0, n_nodes - len(keep))]\n",
          "        keep += []  # MUTATION: the chain only\n"),),
        ("tests/runtime/test_tree.py::test_drafter_drafts_the_best_tree",),
        ("tests/runtime/test_tree.py",),
    ),
    Mutation(
        "topk_reduce_rank_flip",
        "grouped dispatch bitwise == per-token loop: the top-k weighted sum in rank order",
        "pallas_kernels/weighted_reduce/reference.py",
        (("    acc = w[:, 0:1] * y[:, 0]\n    for j in range(1, k):\n        acc = acc + w[:, j:j + 1] * y[:, j]\n",
          "    acc = w[:, k - 1:k] * y[:, k - 1]  # MUTATION: reversed rank order\n"
          "    for j in range(k - 2, -1, -1):\n        acc = acc + w[:, j:j + 1] * y[:, j]\n"),),
        ("tests/pallas_kernels/test_weighted_reduce.py::test_reference_is_rank_order_multiply_then_add",),
        ("tests/pallas_kernels/test_weighted_reduce.py", "tests/experts/test_dispatch.py"),
    ),
    Mutation(
        "gdn_rollback_off_by_one",
        "batched MTP verify == sequential verify, GDN snapshots included (rollback = snapshot a)",
        "sharpi_jax/runtime/speculative.py",
        (("self.state, self._commit = v.state, (v.snaps, len(accepted))",
          "self.state, self._commit = v.state, (v.snaps, max(len(accepted) - 1, 0))  # MUTATION"),),
        ("tests/runtime/test_speculative.py::test_batched_verify_bitwise_equals_sequential[qwen35moe-F32]",),
        ("tests/runtime/test_speculative.py",),
    ),
    Mutation(
        "q4k_scale_nibble",
        "dequantization bitwise == gguf.quants (Q4_K packed 6-bit scales)",
        "sharpi_jax/gguf/quants.py",
        (("sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)",
          "sc = jnp.concatenate([d & 0x3F, (m_d >> 4) | ((d >> 2) & 0x30)], axis=-1)  # MUTATION: high nibble"),),
        ("tests/gguf/test_quants.py::test_random_blocks_bitwise[Q4_K]",),
        ("tests/gguf/test_quants.py", "tests/quant/test_matmul.py"),
    ),
    Mutation(
        "attention_denominator_row_count_dependent",
        "batched verify == sequential decode, bitwise (a row's softmax sum must not depend on the rows beside it)",
        "sharpi_jax/model/attention.py",
        (("l = jnp.where(live, l * alpha + pairwise_sum(p), l)",
          "l = jnp.where(live, l * alpha + jnp.sum(p, axis=-1, keepdims=True), l)  # MUTATION"),),
        ("tests/model/test_attention.py::test_rows_are_bitwise_independent_of_their_batch",),
        ("tests/runtime/test_steps.py",),
    ),
    Mutation(
        "attention_chunks_stop_at_first_row",
        "attention reads the used chunks of the cache: every chunk a valid row sees",
        "sharpi_jax/model/attention.py",
        (("n_chunks = jnp.max(jnp.where(valid, reach, 0)) // C + 1",
          "n_chunks = reach[0] // C + 1  # MUTATION: the first row's reach"),),
        ("tests/model/test_attention.py::test_matches_float64_softmax_over_the_whole_cache",),
        ("tests/model/test_attention.py", "tests/runtime/test_steps.py"),
    ),
    Mutation(
        "tree_over_snapkv_logical_slots",
        "tree verify over a SnapKV-evicted cache == decode along each root path, bitwise",
        "sharpi_jax/model/attention.py",
        (("base = base if shift is None else base - shift",
          "base = base  # MUTATION: the tree's slots at its logical position"),),
        ("tests/model/test_attention.py::test_tree_rows_equal_decode_along_their_root_path_across_a_chunk_boundary",),
        ("tests/model/test_attention.py",),
    ),
    Mutation(
        "tree_path_move_ignores_shift",
        "draft trees over a SnapKV-evicted cache give the tokens of plain decoding with that eviction",
        "sharpi_jax/runtime/state.py",
        (("        off = 0 if c.shift is None else c.shift\n",
          "        off = 0  # MUTATION: the accepted path moved at its positions, not its slots\n"),),
        ("tests/runtime/test_snapkv.py::test_tree_over_an_evicted_cache_equals_plain",),
        ("tests/runtime/test_snapkv.py",),
    ),
    Mutation(
        "tree_rows_unshifted_on_compacted_cache",
        "draft trees over a SnapKV-evicted cache give the tokens of plain decoding with that eviction",
        "sharpi_jax/model/attention.py",
        (("            tree = tree._replace(slots=tree.slots - shift, anc=tree.anc - shift)",
          "            tree = tree._replace(slots=tree.slots, anc=tree.anc - shift)  # MUTATION"),),
        ("tests/runtime/test_snapkv.py::test_tree_over_an_evicted_cache_equals_plain",),
        ("tests/runtime/test_snapkv.py",),
    ),
    Mutation(
        "causal_mask_drops_diagonal",
        "F32 logits vs transformers <= 1e-6 (each row attends to itself and the past)",
        "sharpi_jax/model/attention.py",
        (("seen = slots[None, None, :] <= row_pos  # [1, T, C]",
          "seen = slots[None, None, :] < jnp.maximum(row_pos, 1)  # MUTATION"),),
        ("tests/model/test_fixtures.py::test_f32_logits_match_transformers[tiny-qwen35moe]",),
        ("tests/model/test_fixtures.py",),
    ),
    Mutation(
        "decode_m1_lm_head",
        "batched verify bitwise == single-token decode (every product through the row-stable M >= 2 path)",
        "sharpi_jax/runtime/steps.py",
        (("        return Step(logits[0], hidden[0], state), cache_out(model)\n",
          "        logits = model.lm_head(hidden[:1])  # MUTATION: an M = 1 product in decode only\n"
          "        return Step(logits[0], hidden[0], state), cache_out(model)\n"),),
        ("tests/runtime/test_steps.py::test_verify_is_bitwise_sequential_decode_xla[3]",),
        ("tests/runtime/test_steps.py",),
    ),
    Mutation(
        "grouped_reads_each_expert_twice",
        "grouped dispatch reads each selected expert once per batch (the byte counter)",
        "sharpi_jax/experts/dispatch.py",
        (("        e = b.used[ui]\n", "        e = b.used[ui % b.n_used]  # MUTATION: every expert visited twice\n"),
         ("jax.lax.fori_loop(0, b.n_used, per_expert,", "jax.lax.fori_loop(0, 2 * b.n_used, per_expert,")),
        ("tests/experts/test_dispatch.py", "-k", "test_grouped_equals_per_token_gemm"),
        ("tests/experts/test_dispatch.py",),
    ),
    Mutation(
        "residency_streams_wrong_expert",
        "expert residency (any budget, any policy) is bitwise equal to all-resident",
        "sharpi_jax/experts/residency/slots.py",
        (("pos = pos.at[jnp.where(stream_ids >= 0, stream_ids, E)].set(jnp.arange(n_stage, dtype=jnp.int32))",
          "pos = pos.at[jnp.where(stream_ids >= 0, stream_ids, E)].set(jnp.arange(n_stage, dtype=jnp.int32)[::-1])"),),
        ("tests/experts/test_residency.py", "-k", "test_fixture_bitwise"),
        ("tests/experts/test_residency.py",),
    ),
    Mutation(
        "lookahead_pass_unprotected",
        "expert_lookahead 'pass' / 'both': what was fetched for a verify pass is not evicted until the pass ends",
        "sharpi_jax/experts/residency/slots.py",
        (("return lookahead.protected(v, used, self.spec) if self.spec.lookahead in PASS_MODES else used",
          "return used  # MUTATION: the pass's fetched experts unprotected"),),
        ("tests/experts/test_lookahead.py", "-k", "test_pass_keeps_what_was_fetched_for_the_pass"),
        ("tests/experts/test_lookahead.py",),
    ),
    Mutation(
        "lookahead_predicts_own_layer",
        "expert_lookahead 'next_layer': layer L+1's router on layer L's output predicts layer L+1's experts",
        "sharpi_jax/model/transformer.py",
        (("                blk.prefetch(x, valid)  # a no-op", "                self.layers[i - 1].prefetch(x, valid)  # MUTATION: layer L, not L+1; a no-op"),),
        ("tests/experts/test_lookahead.py", "-k", "test_prediction_is_the_next_layers_router_on_this_layers_output"),
        ("tests/experts/test_lookahead.py",),
    ),
    Mutation(
        "lookahead_buffer_any_layer",
        "expert_lookahead_buffer: the shared buffer's entries serve only the layer they were fetched for",
        "sharpi_jax/experts/residency/lookahead.py",
        (("    mine = (labels[\"layer\"] == layer) & (labels[\"expert\"] >= 0)",
          "    mine = labels[\"expert\"] >= 0  # MUTATION: entries not invalidated when the layer changes"),),
        ("tests/experts/test_lookahead.py", "-k", "test_buffer_serves_the_layer_it_was_filled_for_only"),
        ("tests/experts/test_lookahead.py",),
    ),
    Mutation(
        "lookahead_pass_never_streams",
        "expert_lookahead 'pass': a verify pass streams its cold union (not host-computed below the row threshold)",
        "sharpi_jax/experts/residency/plan.py",
        (("        return self.lookahead in PASS_MODES and self.cold != \"host\" and n_rows >= 2",
          "        return False  # MUTATION: passes follow the cold threshold"),),
        ("tests/experts/test_lookahead.py", "-k", "test_pass_streams_a_verify_union_that_auto_computes_on_the_host"),
        ("tests/experts/test_lookahead.py",),
    ),
    Mutation(
        "mtp_accepts_last_draft_anyway",
        "greedy output with MTP equals output without it (exact-match acceptance)",
        "sharpi_jax/runtime/speculative.py",
        (("            if r < n_draft and tok == int(drafts[r]):\n",
          "            if r < n_draft and (tok == int(drafts[r]) or r == n_draft - 1):  # MUTATION\n"),),
        ("tests/runtime/test_speculative.py::test_greedy_mtp_equals_plain_every_prompt_and_k[qwen35moe-F32]",),
        ("tests/runtime/test_speculative.py",),
    ),
    Mutation(
        "pass_stats_hit_strict",
        "the device loop gives the host loop's pass stats exactly (one pass_stats for chain and tree)",
        "sharpi_jax/runtime/passes.py",
        (("                hit=[sum(d >= i and a >= i for _, d, a in passes) for i in range(1, k + 1)])",
          "                hit=[sum(d >= i and a > i for _, d, a in passes) for i in range(1, k + 1)])  # MUTATION"),),
        ("tests/runtime/test_device_loop.py::test_fixture_greedy[qwen35moe-Q8_0]",),
        ("tests/runtime/test_device_loop.py", "tests/runtime/test_tree.py"),
    ),
    Mutation(
        "eos_stops_one_late",
        "generation stops right after the first end-of-generation token, with and without MTP",
        "sharpi_jax/runtime/passes.py",
        (("            out.append(tok)\n            if tok in stop_ids:\n                return out, \"eos\"\n",
          "            if out and out[-1] in stop_ids:  # MUTATION: one token late\n"
          "                return out + [tok], \"eos\"\n            out.append(tok)\n"),),
        ("tests/runtime/test_speculative.py::test_stats_and_stops",),
        ("tests/test_api.py::test_eos_inside_accepted_drafts_stops_generate", "tests/runtime/test_tree.py"),
    ),
    Mutation(
        "tokenizer_qwen35_drops_marks",
        "tokenizer ids equal llama.cpp's (the qwen35 pre-split keeps combining marks in letter runs)",
        "sharpi_jax/gguf/tokenizer.py",
        ((r'r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|', r'r"|[^\r\n\p{L}\p{N}]?\p{L}+|'),),
        ("tests/gguf/test_tokenizer.py::test_qwen35_vs_qwen2_marks",),
        ("tests/gguf/test_tokenizer.py",),
    ),
    Mutation(
        "expert_parallel_wrong_owner",
        "expert parallelism: logits BITWISE those of one device (each pair summed from its owner)",
        "sharpi_jax/experts/parallel.py",
        (("first = jax.lax.axis_index(EXPERT_AXIS).astype(jnp.int32) * e_local",
          "first = (jax.lax.axis_index(EXPERT_AXIS).astype(jnp.int32) * e_local + 1) % experts.n_expert"),),
        ("tests/experts/test_expert_parallel.py", "-k", "dispatch"),
        ("tests/experts/test_expert_parallel.py",),
    ),
    Mutation(
        "expert_parallel_second_collective",
        "expert parallelism: ONE psum over the expert axis, 4*k*D bytes per token and MoE layer",
        "sharpi_jax/experts/parallel.py",
        (("return jax.lax.bitcast_convert_type(jax.lax.psum(bits, EXPERT_AXIS), jnp.float32)",
          "return jax.lax.bitcast_convert_type(jax.lax.pmax(jax.lax.psum(bits, EXPERT_AXIS), EXPERT_AXIS), "
          "jnp.float32)  # MUTATION: a second all-reduce"),),
        ("tests/experts/test_expert_parallel.py", "-k", "compiled_collectives"),
        ("tests/experts/test_expert_parallel.py",),
    ),
    Mutation(
        "tree_row_view_shifted",
        "tree verify: every node's logits, hidden and GDN snapshot == decode along its root path, bitwise",
        "sharpi_jax/model/tree.py",
        (("own = jnp.take_along_axis(anc, jnp.broadcast_to(jnp.clip(rel, 0, W - 1), (anc.shape[0], slots.shape[0])), axis=1)",
          "own = jnp.take_along_axis(anc, jnp.broadcast_to(jnp.clip(rel - 1, 0, W - 1), (anc.shape[0], slots.shape[0])), "
          "axis=1)  # MUTATION: each row's view misses its own key"),),
        ("tests/runtime/test_tree.py::test_tree_nodes_bitwise_equal_decode_along_root_path[qwen35moe-F32]",),
        ("tests/runtime/test_tree.py",),
    ),
    Mutation(
        "int8_repack_truncates",
        "int8 repacking stays within half a step per weight (max|row| / 254)",
        "sharpi_jax/quant/qtensor.py",
        (("q = jnp.clip(jnp.round(w * inv), -127, 127).astype(jnp.int8)",
          "q = jnp.clip(jnp.trunc(w * inv), -127, 127).astype(jnp.int8)  # MUTATION: truncation"),),
        ("tests/quant/test_matmul.py", "-k", "test_int8_repack_error_bound"),
        ("tests/quant/test_matmul.py",),
    ),
    Mutation(
        "ggml_composed_loops_jax_silu",
        "expert residency (any budget, policy) == all-resident with kernels='ggml': the composed loops run "
        "ggml's fused expert op one expert at a time (Backend.expert_ffn), not a JAX SiLU between two matmuls",
        "sharpi_jax/quant/backends/ggml.py",
        (("    def expert_ffn(self, x: jax.Array, loaded, stacks) -> jax.Array:\n",
          "    def _unused_expert_ffn(self, x: jax.Array, loaded, stacks) -> jax.Array:  # MUTATION\n"),),
        ("tests/experts/test_dispatch.py", "-k", "test_ggml_fused_grouped_equals_composed_per_token"),
        ("tests/experts/test_residency.py",),
    ),
    Mutation(
        "ggml_expert_parallel_foreign_ids",
        "expert parallelism with kernels='ggml': a device's op skips the other devices' pairs (id -1), so "
        "its logits are bitwise one device's",
        "sharpi_jax/quant/backends/ggml.py",
        (("keep = (sel >= 0) & (sel < n_expert)",
          "keep = jnp.ones(sel.shape, bool)  # MUTATION: other devices' pairs passed through"),),
        ("tests/experts/test_expert_parallel.py", "-k", "test_logits_bitwise_equal_one_device"),
        ("tests/experts/test_expert_parallel.py",),
    ),
    Mutation(
        "ggml_padding_rows_multiplied",
        "kernels='ggml': a bucket's padding rows (decode's second row, a verify bucket's unused rows) are "
        "not multiplied",
        "sharpi_jax/model/layers.py",
        (("ys = [matmul(x, p, rows=rows) for p in self.parts()]",
          "ys = [matmul(x, p) for p in self.parts()]  # MUTATION: padding rows multiplied"),),
        ("tests/quant/test_engine_backends.py", "-k", "test_ggml_skips_bucket_padding_rows"),
    ),
    Mutation(
        "ggml_padding_experts_computed",
        "kernels='ggml': a bucket's padding rows read and compute no experts",
        "sharpi_jax/quant/backends/ggml.py",
        (("            keep &= valid[:, None]\n", "            pass  # MUTATION: padding rows computed\n"),),
        ("tests/quant/test_ggml.py", "-k", "test_backend_grouped_op_skips_padding_rows"),
    ),
    Mutation(
        "draft_vocab_counts_every_output",
        "calibrate_draft_vocab ranks ids by the MTP head's drafts that equal the target's greedy token",
        "sharpi_jax/runtime/draft_vocab.py",
        (("    for t in np.asarray(target)[np.asarray(draft) == np.asarray(target)].tolist():\n",
          "    for t in np.asarray(target).tolist():  # MUTATION: every output counted, drafted correctly or not\n"),),
        ("tests/runtime/test_draft_vocab.py::test_output_unchanged_and_calibration_saved",),
    ),
    Mutation(
        "draft_vocab_argmax_unmapped",
        "draft_vocab=N: the draft is the subset's argmax mapped back to its token id",
        "sharpi_jax/runtime/draft_vocab.py",
        (("        return self.ids[jnp.argmax(logits)].astype(jnp.int32)\n",
          "        return jnp.argmax(logits).astype(jnp.int32)  # MUTATION: the subset index as a token id\n"),),
        ("tests/runtime/test_draft_vocab.py::test_subset_head_is_the_full_head_restricted",),
    ),
    Mutation(
        "pallas_reduce_drops_last_rank",
        "pallas (interpret on CPU) matches the reference: the weighted top-k reduce kernel",
        "pallas_kernels/weighted_reduce/kernel.py",
        (("    for j in range(1, k):\n        acc = acc + w_refs[j][...] * y_refs[j][...]\n",
          "    for j in range(1, k - 1):  # MUTATION: the last rank dropped\n"
          "        acc = acc + w_refs[j][...] * y_refs[j][...]\n"),),
        ("tests/pallas_kernels/test_weighted_reduce.py", "-k", "test_kernel_interpret_equals_reference_bitwise"),
        ("tests/pallas_kernels/", "tests/experts/test_dispatch.py::test_pallas_mode_interpret"),
    ),
    Mutation(
        "chat_range_limit_removed",
        "chat templates are bounded: a range over max_range items is one error naming that limit",
        "sharpi_jax/gguf/chat.py",
        (("    if n > lim.max_range:\n", "    if False:  # MUTATION: the range limit check removed\n"),),
        ("tests/gguf/test_chat_limits.py", "-k", "huge_range or tight_limits"),
    ),
    Mutation(
        "chat_output_limit_removed",
        "chat templates are bounded: the text a template emits (captured blocks, macro bodies) is capped",
        "sharpi_jax/gguf/chat.py",
        (("    if (r.emitted if r is not None else size) > lim.max_output:\n",
          "    if r is None and size > lim.max_output:  # MUTATION: the running emitted total not checked\n"),),
        ("tests/gguf/test_chat_limits.py", "-k", "captured_block or macro_body or tight_limits"),
    ),
    Mutation(
        "chat_tojson_ascii",
        "chat templates render as transformers: tojson keeps non-ASCII text",
        "sharpi_jax/gguf/chat.py",
        (("def _tojson(x: Any, ensure_ascii: bool = False,", "def _tojson(x: Any, ensure_ascii: bool = True,"),),
        ("tests/gguf/test_chat_limits.py", "-k", "tojson"),
    ),
    Mutation(
        "compiled_cache_kept_on_close",
        "a closed engine releases its compiled code: the graph's jitted functions go with its last holder",
        "sharpi_jax/runtime/compiled.py",
        (("        ns = cache.pop(graph, None)\n", "        ns = cache.get(graph)  # MUTATION: cache not cleared on close\n"),),
        ("tests/runtime/test_compiled.py", "-k", "hold_release"),
        ("tests/test_engine_lifetime.py",),
    ),
    Mutation(
        "derived_loop_cache_kept_on_close",
        "a closed engine releases its compiled code: the device loops built from its steps go too",
        "sharpi_jax/runtime/compiled.py",
        (("        for key in [k for k in cache if any(id(f) in dropped for f in k)]:\n",
          "        for key in []:  # MUTATION: cache not cleared on close\n"),),
        ("tests/runtime/test_compiled.py", "-k", "hold_release"),
        ("tests/test_engine_lifetime.py",),
    ),
    Mutation(
        "top_p_ignores_top_k",
        "top-p keeps the shortest prefix of the top-k (renormalized) distribution reaching top_p",
        "sharpi_jax/runtime/sampling.py",
        (("    p = jax.nn.softmax(jnp.where(jnp.arange(V) < k, desc, -jnp.inf))\n",
          "    p = jax.nn.softmax(desc)  # MUTATION: the mass of the whole vocabulary\n"),),
        ("tests/runtime/test_sampling_reference.py",),
    ),
    Mutation(
        "ring_evicts_most_recent",
        "residency rings evict the least recently used unused slot, probation before protected",
        "sharpi_jax/experts/residency/policies.py",
        (("        return ring[jnp.lexsort((stamp_r, prot_r, used_r))[:n]]",
          "        return ring[jnp.lexsort((-stamp_r, prot_r, used_r))[:n]]  # MUTATION: most recent first\n"
          "        #"),),
        ("tests/experts/test_policy_reference.py", "-k", "step_by_step and lru-0"),
    ),
    Mutation(
        "slru_demotes_newest",
        "SLRU: beyond the protected cap, the least recently used protected slots drop back to probation",
        "sharpi_jax/experts/residency/policies.py",
        (("    order = jnp.lexsort((stamp, ~cand))\n", "    order = jnp.lexsort((-stamp, ~cand))  # MUTATION\n"),),
        ("tests/experts/test_policy_reference.py", "-k", "slru"),
    ),
    Mutation(
        "entry_point_error_traceback",
        "an entry point's bad input is one line, `error: ...`, and exit status 2, wherever in the run it is raised",
        "experiments/cli.py",
        (("            return fail(e)\n", "            raise  # MUTATION: a library error ends in a traceback\n"),),
        ("tests/experiments/test_entry_points.py", "-k", "perplexity_bad_corpus or snapkv_bad_budget"),
    ),
    Mutation(
        "cli_bench_prefix_dropped",
        "sharpi COMMAND runs python -m experiments.COMMAND; sharpi bench NAME runs experiments.bench_NAME",
        "sharpi_jax/cli.py",
        (("        command, rest = BENCH_PREFIX + rest[0], rest[1:]\n",
          "        command, rest = rest[0], rest[1:]  # MUTATION: bench NAME runs experiments.NAME\n"),),
        ("tests/test_cli.py", "-k", "commands_name_their_entry_point"),
    ),
    Mutation(
        "stats_chain_none_dropped",
        "GenerateStats.to_dict gives the loops' flat stats back, key for key (the chain's None values too)",
        "sharpi_jax/runtime/stats.py",
        (("                if value is not None or f.name in keep:\n",
          "                if value is not None:  # MUTATION: the chain's None-valued keys dropped\n"),),
        ("tests/runtime/test_stats.py", "-k", "test_round_trip and not real"),
    ),
    Mutation(
        "ep_budget_streams_local_ids",
        "expert parallelism with a per-device budget: each device streams its own experts (by global id)",
        "sharpi_jax/experts/residency/slots.py",
        (("            shard.global_ids(stream_ids), shard.global_ids(host_ids), u, shard.sel)\n",
          "            stream_ids, host_ids, u, shard.sel)  # MUTATION: local ids read from the file\n"),),
        ("tests/experts/test_expert_parallel.py", "-k", "per_device_budget_gives"),
    ),
    Mutation(
        "ep_budget_other_pairs_summed",
        "expert parallelism (with a per-device budget too): the psum adds only each pair's owner's rows",
        "sharpi_jax/experts/parallel.py",
        (("    bits = jnp.where(owned[..., None], jax.lax.bitcast_convert_type(y, jnp.int32), 0)\n",
          "    bits = jax.lax.bitcast_convert_type(y, jnp.int32)  # MUTATION: every device's rows summed\n"),),
        ("tests/experts/test_expert_parallel.py", "-k", "per_device_budget_gives"),
    ),
    Mutation(
        "pinned_store_reads_first_miss",
        "the pinned host store moves each missed expert (not the first miss's bytes for every one)",
        "sharpi_jax/experts/residency/slots.py",
        (("            rows = [jax.tree.map(lambda a: one(a, ids[j]), q.data) for j in range(ids.shape[0])]\n",
          "            rows = [jax.tree.map(lambda a: one(a, ids[0]), q.data) for j in range(ids.shape[0])]  # MUTATION\n"),),
        ("tests/experts/test_pinned_store.py", "-k", "all_resident_bits"),
    ),
    Mutation(
        "wheel_kernels_top_level",
        "the wheel installs only sharpi_jax at the top of site-packages",
        "pyproject.toml",
        (('"sharpi_jax/pallas_kernels" = "pallas_kernels"', '"pallas_kernels" = "pallas_kernels"'),),
        ("tests/test_cli.py", "-k", "wheel_installs_only_sharpi_jax"),
    ),
    Mutation(
        "calibration_takes_the_engine",
        "imports and calls run one way: nothing below api takes the Engine",
        "sharpi_jax/runtime/draft_vocab.py",
        (("def count_accepted(counts: dict[int, int], target: np.ndarray, draft: np.ndarray) -> None:\n",
          "def count_accepted(counts: dict[int, int], target: np.ndarray, draft: np.ndarray,\n"
          "                   engine=None) -> None:  # MUTATION: a calibration that calls back up\n"),),
        ("tests/test_imports.py", "-k", "takes_an_engine"),
    ),
    Mutation(
        "shortcut_tree_nodes_dropped",
        "keyword shortcuts build the same typed options as the types written out",
        "sharpi_jax/runtime/options.py",
        (("            spec = Tree(draft_tokens, tree_nodes, max_snapshot_bytes)\n",
          "            spec = Tree(draft_tokens, None, max_snapshot_bytes)  # MUTATION: tree_nodes ignored\n"),),
        ("tests/runtime/test_options.py", "-k", "shortcuts"),
    ),
    Mutation(
        "load_shortcut_residency_keyword_dropped",
        "keyword shortcuts build the same typed options as the types written out",
        "sharpi_jax/experts/residency/options.py",
        (("        return cls(expert_budget, expert_policy, **{n.removeprefix(\"expert_\"): v for n, v in checked.items()})\n",
          "        return cls(expert_budget, expert_policy, **{n.removeprefix(\"expert_\"): v for n, v in checked.items()\n"
          "                                                    if n != \"expert_lookahead\"})  # MUTATION\n"),),
        ("tests/runtime/test_options.py", "-k", "shortcuts"),
    ),
    Mutation(
        "typed_option_unchecked",
        "every option is checked where it enters: one line naming it",
        "sharpi_jax/runtime/options.py",
        (("        _choice(\"loop\", self.loop, LOOP_CHOICES)\n", ""),),
        ("tests/runtime/test_options.py", "-k", "bad_values"),
    ),
)


def by_name(name: str) -> Mutation:
    for m in MUTATIONS:
        if m.name == name:
            return m
    raise KeyError(f"no mutation named {name!r}; known: {', '.join(m.name for m in MUTATIONS)}")
