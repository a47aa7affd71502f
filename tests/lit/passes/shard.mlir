// RUN: %kiln opt %s --passes='shard{ranks=2 rank=0 sharding=row_wise}' | FileCheck %s --check-prefix=ROW
// RUN: %kiln opt %s --passes='shard{ranks=2 rank=1 sharding=table_wise}' | FileCheck %s --check-prefix=AWAY
// RUN: %kiln opt %s --passes='shard{ranks=2 rank=0 sharding=data_parallel}' | FileCheck %s --check-prefix=DP
// RUN: %kiln opt %s --passes='shard{ranks=2 rank=1 plan=%S/Inputs/hot_plan.json}' | FileCheck %s --check-prefix=HOT
// RUN: %kiln opt %s --passes='shard{ranks=2 rank=1 plan=%S/Inputs/dedup_plan.json}' | FileCheck %s --check-prefix=DEDUP
// RUN: not %kiln opt %s --passes='shard{ranks=2 rank=1 plan=%S/Inputs/dedup_column.json}' 2>&1 | FileCheck %s --check-prefix=DEDUPCOL
// RUN: not %kiln opt %s --passes='shard{ranks=2 rank=2}' 2>&1 | FileCheck %s --check-prefix=BAD
// RUN: not %kiln opt %s --passes='shard{ranks=2 sharding=diagonal}' 2>&1 | FileCheck %s --check-prefix=BADTYPE

// row_wise over 2 ranks: rank 0 holds rows [0, 5) and their state, and says where they lie.
// ROW:       %tables.0 = "kiln.parameter"() {{{.*}}global_shape = [10, 2]{{.*}}offset = [0, 0]{{.*}} -> !kiln.tensor<5x2xf32>
// ROW:       "kiln.parameter"() {{{.*}}global_shape = [10]{{.*}}offset = [0]{{.*}} -> !kiln.tensor<5xf32>
// The ids go to their owners, the partial pools come back summed.
// ROW:       "kiln.bucketize_ids"(%cats.0) {{{.*}}mode = "partition", owners = [0, 1]{{.*}}row_starts = [0, 5, 10]
// ROW:       "kiln.all_to_all"
// ROW:       "kiln.all_to_all_v"
// ROW:       "kiln.embedding_bag"(%tables.0, {{.*}} : (!kiln.tensor<5x2xf32>, !kiln.tensor<?(2*B)xi64>, !kiln.tensor<2*Bxi64>) -> !kiln.tensor<2*Bx2xf32>
// ROW:       "kiln.reduce_scatter"({{.*}}) {axis = 0, group = "world", ranks = 2} : (!kiln.tensor<2*Bx2xf32>) -> !kiln.tensor<Bx2xf32>
// The dense gradients: one bucket (5 floats) once both are computed, all-reduced and halved
// (the global loss is the mean of the 2 ranks' mean losses), then split back.
// ROW:       %grad_bucket.0 = "kiln.concat"
// ROW-SAME:  -> !kiln.tensor<5xf32>
// ROW:       "kiln.all_reduce"(%grad_bucket.0) {group = "world", ranks = 2} : (!kiln.tensor<5xf32>) -> !kiln.tensor<5xf32>
// ROW:       "kiln.constant"() {value = 0.5}
// The pools' gradient, halved too, of the global batch comes back for the update of the rows
// this rank owns.
// ROW:       "kiln.constant"() {value = 0.5}
// ROW:       "kiln.all_gather"({{.*}}) {axis = 0, group = "world", ranks = 2} : (!kiln.tensor<Bx2xf32>) -> !kiln.tensor<2*Bx2xf32>
// ROW:       "kiln.embedding_bag_update"(%tables.0, {{.*}}) {{.*}} : (!kiln.tensor<5x2xf32>, !kiln.tensor<?(2*B)xi64>, !kiln.tensor<2*Bxi64>, !kiln.tensor<2*Bx2xf32>, !kiln.tensor<5xf32>
// ROW:       "kiln.optimizer_update"(%logit.0.weight
// ROW:       "kiln.optimizer_update"(%logit.0.bias

// table_wise round robin puts the one table on rank 0: rank 1 holds no table, sends its ids,
// gets its pools back and sends their gradients; it runs no lookup and no update.
// AWAY-NOT:  "kiln.parameter"() {{{.*}}name = "tables.0"
// AWAY:      "kiln.all_to_all_v"
// AWAY:      "kiln.all_to_all_v"({{.*}}) {{.*}} : (!kiln.tensor<0x2xf32>, !kiln.tensor<2xi64>) -> (!kiln.tensor<Bx2xf32>, !kiln.tensor<2xi64>)
// AWAY-NOT:  "kiln.embedding_bag"
// AWAY:      "kiln.all_to_all_v"({{.*}}) {{.*}} : (!kiln.tensor<Bx2xf32>, !kiln.tensor<2xi64>) -> (!kiln.tensor<0x2xf32>, !kiln.tensor<2xi64>)
// AWAY-NOT:  "kiln.embedding_bag_update"

// data_parallel: the lookup stays; every replica applies the global batch's update.
// DP:        "kiln.embedding_bag"(%tables.0, %cats.0)
// DP:        "kiln.bucketize_ids"(%cats.0) {{{.*}}mode = "replicate", owners = [0, 1]
// DP:        "kiln.all_gather"
// DP:        "kiln.embedding_bag_update"(%tables.0, {{.*}}) {{.*}} : (!kiln.tensor<10x2xf32>, !kiln.tensor<?(2*B)xi64>, !kiln.tensor<2*Bxi64>, !kiln.tensor<2*Bx2xf32>

// A hybrid table (Inputs/hot_plan.json: row_wise with rows 1, 4, 7 hot): every rank holds a replica
// of the hot rows and of their state, placed in the whole tensors by hot_of and hot_rows.
// HOT:       %tables.0.hot = "kiln.parameter"() {global_shape = [10, 2]{{.*}}hot_of = "tables.0", hot_rows = [1, 4, 7]{{.*}} -> !kiln.tensor<3x2xf32>
// HOT:       %tables.0.rowwise_adagrad_sum.hot = "kiln.parameter"() {global_shape = [10], hot_of = "tables.0.rowwise_adagrad_sum", hot_rows = [1, 4, 7]{{.*}}state_of = "tables.0.hot"{{.*}} -> !kiln.tensor<3xf32>
// The hot ids are looked up at home; only the cold ones go to their owners, and only the samples
// that sent an owner ids get its pools back (compacted, then put back in place); the pools add.
// HOT:       %[[SPLIT:.*]]:4 = "kiln.split_hot_ids"(%cats.0) {hot_rows = [1, 4, 7], rows = 10, table = "tables.0"}
// HOT:       %[[HOTPOOL:.*]] = "kiln.embedding_bag"(%tables.0.hot, %[[SPLIT]]#0, %[[SPLIT]]#1)
// HOT:       %[[BUCKET:.*]]:4 = "kiln.bucketize_ids"(%[[SPLIT]]#2, %[[SPLIT]]#3) {{{.*}}mode = "partition"
// HOT:       %[[ARRIVED:.*]] = "kiln.all_to_all"(%[[BUCKET]]#1)
// HOT:       "kiln.compact_rows"({{.*}}, %[[ARRIVED]]) {group = "world", ranks = 2} : (!kiln.tensor<2*Bx2xf32>, !kiln.tensor<2*Bxi64>) -> (!kiln.tensor<?(2*B)x2xf32>, !kiln.tensor<2xi64>)
// HOT:       %[[BACK:.*]]:2 = "kiln.all_to_all_v"
// HOT:       %[[COLD:.*]] = "kiln.expand_rows"(%[[BACK]]#0, %[[BUCKET]]#1) {blocks = 2} : (!kiln.tensor<?(2*B)x2xf32>, !kiln.tensor<2*Bxi64>) -> !kiln.tensor<Bx2xf32>
// HOT:       "kiln.add"(%[[HOTPOOL]], %[[COLD]])
// The cold rows' gradients go back the same compacted way; the hot rows' gradient is a dense
// [3, 2] block riding in the dense bucket (1 + 4 + 6 floats), and the replica's update visits
// each hot row once, last.
// HOT:       "kiln.compact_rows"({{.*}}, %[[BUCKET]]#1)
// HOT:       "kiln.all_to_all_v"
// HOT:       "kiln.expand_rows"({{.*}}, %[[ARRIVED]])
// HOT:       "kiln.embedding_bag_update"(%tables.0, {{.*}} -> ()
// HOT:       %[[DENSE:.*]] = "kiln.embedding_bag_dense_grad"(%[[SPLIT]]#0, %[[SPLIT]]#1, {{.*}}) {mode = "sum", rows = 3, table = "tables.0.hot"}
// HOT:       "kiln.all_reduce"({{.*}}) {group = "world", ranks = 2} : (!kiln.tensor<11xf32>) -> !kiln.tensor<11xf32>
// HOT:       %[[ROWS:.*]] = "kiln.constant"() {value = [0, 1, 2]} : () -> !kiln.tensor<3x1xi64>
// HOT:       "kiln.embedding_bag_update"(%tables.0.hot, %[[ROWS]], {{.*}}, %tables.0.rowwise_adagrad_sum.hot, %lr, %step) {{.*}}table = "tables.0.hot"
// HOT-NEXT:  return

// BAD: shard: rank 2 is not below ranks = 2
// BADTYPE: shard: unknown sharding 'diagonal' (use data_parallel, table_wise, row_wise, column_wise, table_row_wise)
module {
  func.func @train_step() -> (!kiln.tensor<f32>, !kiln.tensor<Bx1xf32>) {
    %lr = "kiln.input"() {name = "lr", role = "lr"} : () -> !kiln.tensor<f32>
    %step = "kiln.input"() {name = "step", role = "step"} : () -> !kiln.tensor<f32>
    %dense = "kiln.input"() {name = "dense", role = "dense"} : () -> !kiln.tensor<Bx2xf32>
    %cats.0 = "kiln.input"() {feature = 0, hotness = 1, id_map = "modulo", name = "cats.0", role = "sparse", rows = 10} : () -> !kiln.tensor<Bx1xi64>
    %label = "kiln.input"() {name = "label", role = "label"} : () -> !kiln.tensor<Bxf32>
    %tables.0 = "kiln.parameter"() {embedding = true, high = 0.31622776601683794, init = "uniform", low = -0.31622776601683794, name = "tables.0", trainable = true} : () -> !kiln.tensor<10x2xf32>
    %tables.0.rowwise_adagrad_sum = "kiln.parameter"() {init = "zeros", name = "tables.0.rowwise_adagrad_sum", state_of = "tables.0", trainable = false} : () -> !kiln.tensor<10xf32>
    %logit.0.weight = "kiln.parameter"() {init = "xavier_uniform", name = "logit.0.weight", trainable = true} : () -> !kiln.tensor<1x4xf32>
    %logit.0.bias = "kiln.parameter"() {init = "zeros", name = "logit.0.bias", trainable = true} : () -> !kiln.tensor<1xf32>
    %tables.0.pooled = "kiln.embedding_bag"(%tables.0, %cats.0) {mode = "sum", table = "tables.0"} : (!kiln.tensor<10x2xf32>, !kiln.tensor<Bx1xi64>) -> !kiln.tensor<Bx2xf32>
    %0 = "kiln.concat"(%dense, %tables.0.pooled) {axis = 1} : (!kiln.tensor<Bx2xf32>, !kiln.tensor<Bx2xf32>) -> !kiln.tensor<Bx4xf32>
    %1 = "kiln.matmul"(%0, %logit.0.weight) {transpose_a = false, transpose_b = true} : (!kiln.tensor<Bx4xf32>, !kiln.tensor<1x4xf32>) -> !kiln.tensor<Bx1xf32>
    %logit = "kiln.add"(%1, %logit.0.bias) : (!kiln.tensor<Bx1xf32>, !kiln.tensor<1xf32>) -> !kiln.tensor<Bx1xf32>
    %2 = "kiln.reshape"(%logit) : (!kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bxf32>
    %loss = "kiln.bce_with_logits"(%2, %label) {reduction = "mean"} : (!kiln.tensor<Bxf32>, !kiln.tensor<Bxf32>) -> !kiln.tensor<f32>
    %3 = "kiln.constant"() {value = 1.0} : () -> !kiln.tensor<f32>
    %4 = "kiln.bce_with_logits_grad"(%2, %label, %3) {reduction = "mean"} : (!kiln.tensor<Bxf32>, !kiln.tensor<Bxf32>, !kiln.tensor<f32>) -> !kiln.tensor<Bxf32>
    %5 = "kiln.reshape"(%4) : (!kiln.tensor<Bxf32>) -> !kiln.tensor<Bx1xf32>
    %6 = "kiln.sum_to"(%5) : (!kiln.tensor<Bx1xf32>) -> !kiln.tensor<1xf32>
    %7 = "kiln.matmul"(%5, %logit.0.weight) {transpose_a = false, transpose_b = false} : (!kiln.tensor<Bx1xf32>, !kiln.tensor<1x4xf32>) -> !kiln.tensor<Bx4xf32>
    %8 = "kiln.matmul"(%5, %0) {transpose_a = true, transpose_b = false} : (!kiln.tensor<Bx1xf32>, !kiln.tensor<Bx4xf32>) -> !kiln.tensor<1x4xf32>
    %9 = "kiln.slice"(%7) {axis = 1, limit = 4, start = 2} : (!kiln.tensor<Bx4xf32>) -> !kiln.tensor<Bx2xf32>
    "kiln.embedding_bag_update"(%tables.0, %cats.0, %9, %tables.0.rowwise_adagrad_sum, %lr, %step) {beta1 = 0.9, beta2 = 0.999, eps = 1.0e-08, initial_accumulator = 0.0, lr = 0.05, mode = "sum", optimizer = "rowwise_adagrad", scaled = false, table = "tables.0", weight_decay = 0.0, weighted = false} : (!kiln.tensor<10x2xf32>, !kiln.tensor<Bx1xi64>, !kiln.tensor<Bx2xf32>, !kiln.tensor<10xf32>, !kiln.tensor<f32>, !kiln.tensor<f32>) -> ()
    "kiln.optimizer_update"(%logit.0.weight, %8, %lr, %step) {beta1 = 0.9, beta2 = 0.999, eps = 1.0e-08, kind = "sgd", lr = 0.1, momentum = 0.0, nesterov = false, param = "logit.0.weight", scaled = false, weight_decay = 0.0} : (!kiln.tensor<1x4xf32>, !kiln.tensor<1x4xf32>, !kiln.tensor<f32>, !kiln.tensor<f32>) -> ()
    "kiln.optimizer_update"(%logit.0.bias, %6, %lr, %step) {beta1 = 0.9, beta2 = 0.999, eps = 1.0e-08, kind = "sgd", lr = 0.1, momentum = 0.0, nesterov = false, param = "logit.0.bias", scaled = false, weight_decay = 0.0} : (!kiln.tensor<1xf32>, !kiln.tensor<1xf32>, !kiln.tensor<f32>, !kiln.tensor<f32>) -> ()
    return %loss, %logit : !kiln.tensor<f32>, !kiln.tensor<Bx1xf32>
  }
}

// De-duplicated ids (Inputs/dedup_plan.json): each distinct id goes once to its owner, which
// sends back its row; the rank pools its samples from those rows by the inverse index. The
// gradient of each distinct row goes back the same way, and the owner updates it once per peer.
// DEDUP:       %[[D:.*]]:3 = "kiln.dedup_ids"(%cats.0) {{{.*}}owners = [0, 1], rank = 1, ranks = 2, row_starts = [0, 5, 10], rows = 10, table = "tables.0"} : (!kiln.tensor<Bx1xi64>) -> (!kiln.tensor<?(B)xi64>, !kiln.tensor<Bx1xi64>, !kiln.tensor<2xi64>)
// DEDUP:       %[[IDS:.*]]:2 = "kiln.all_to_all_v"(%[[D]]#0, %[[D]]#2) {expected_fill = 0.25
// DEDUP:       %[[ROWS:.*]] = "kiln.gather"(%tables.0, %[[IDS]]#0) {axis = 0} : (!kiln.tensor<5x2xf32>, !kiln.tensor<?(2*B)xi64>) -> !kiln.tensor<?(2*B)x2xf32>
// DEDUP:       %[[BACK:.*]]:2 = "kiln.all_to_all_v"(%[[ROWS]], %[[IDS]]#1) {{.*}} -> (!kiln.tensor<?(B)x2xf32>, !kiln.tensor<2xi64>)
// DEDUP:       "kiln.embedding_bag"(%[[BACK]]#0, %[[D]]#1) {mode = "sum", table = "tables.0"} : (!kiln.tensor<?(B)x2xf32>, !kiln.tensor<Bx1xi64>) -> !kiln.tensor<Bx2xf32>
// DEDUP-NOT:   "kiln.reduce_scatter"
// DEDUP:       %[[G:.*]] = "kiln.embedding_bag_dense_grad"(%[[D]]#1, {{.*}}) {mode = "sum", table = "tables.0"} : (!kiln.tensor<Bx1xi64>, !kiln.tensor<Bx2xf32>) -> !kiln.tensor<?(B)x2xf32>
// DEDUP:       %[[GB:.*]]:2 = "kiln.all_to_all_v"(%[[G]], %[[D]]#2)
// DEDUP:       %[[UIDS:.*]] = "kiln.reshape"(%[[IDS]]#0) : (!kiln.tensor<?(2*B)xi64>) -> !kiln.tensor<?(2*B)x1xi64>
// DEDUP:       "kiln.embedding_bag_update"(%tables.0, %[[UIDS]], %[[GB]]#0, %tables.0.rowwise_adagrad_sum, %lr, %step)

// DEDUPCOL: dedup_column.json:2:13: error: in pass 'shard': table 'tables.0' is column_wise: only row blocks (table_wise, row_wise, table_row_wise) route de-duplicated ids
