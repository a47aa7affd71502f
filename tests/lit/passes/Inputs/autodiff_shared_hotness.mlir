module attributes {kiln.outputs = ["logit", "loss"], kiln.train = {embedding_optimizer = {kind = "adagrad", lr = 0.05}, label = "label", loss = "loss", optimizer = {kind = "sgd", lr = 0.1}, prediction = "logit"}} {
  func.func @forward() -> (!kiln.tensor<Bxf32>, !kiln.tensor<f32>) {
    %label = "kiln.input"() {name = "label", role = "label"} : () -> !kiln.tensor<Bxf32>
    %home = "kiln.input"() {name = "cats.0", role = "sparse", feature = 0, rows = 100, hotness = 2} : () -> !kiln.tensor<Bx2xi64>
    %away = "kiln.input"() {name = "cats.1", role = "sparse", feature = 1, rows = 100, hotness = 1} : () -> !kiln.tensor<Bx1xi64>
    %table = "kiln.parameter"() {name = "city.0", embedding = true, init = "normal"} : () -> !kiln.tensor<100x1xf32>
    %e0 = "kiln.embedding_bag"(%table, %home) {mode = "sum", table = "city.0"} : (!kiln.tensor<100x1xf32>, !kiln.tensor<Bx2xi64>) -> !kiln.tensor<Bx1xf32>
    %e1 = "kiln.embedding_bag"(%table, %away) {mode = "sum", table = "city.0"} : (!kiln.tensor<100x1xf32>, !kiln.tensor<Bx1xi64>) -> !kiln.tensor<Bx1xf32>
    %y = "kiln.add"(%e0, %e1) : (!kiln.tensor<Bx1xf32>, !kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bx1xf32>
    %logit = "kiln.reshape"(%y) : (!kiln.tensor<Bx1xf32>) -> !kiln.tensor<Bxf32>
    %loss = "kiln.bce_with_logits"(%logit, %label) : (!kiln.tensor<Bxf32>, !kiln.tensor<Bxf32>) -> !kiln.tensor<f32>
    return %logit, %loss : !kiln.tensor<Bxf32>, !kiln.tensor<f32>
  }
}
