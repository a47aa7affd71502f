// The HTTP face of `kiln serve`: the Open Inference Protocol (KServe v2, as Triton, TF Serving
// and ONNX Runtime speak it) and a Prometheus /metrics endpoint, over cpp-httplib (Debian's
// libcpp-httplib-dev; docs/serving.md says why). Every request is answered from what the server
// was started with: no endpoint names a path or loads a model.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "ir/status.h"
#include "runtime/data/batch.h"
#include "tools/model_server.h"

namespace httplib {
class Server;
}

namespace kiln::cli {

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (the bound one is printed)
  int64_t max_request_bytes = 16 << 20;
  int threads = 16;        // connections served at once
  int read_timeout_s = 5;  // a client that sends nothing for this long is dropped
  std::string version;     // of Kiln, for GET /v2
};

// An infer request's body as a batch of the model's inputs (the label, when the model has one
// and the request does not, is zeros). Errors are the 400 messages, naming the input at fault.
// Sizes are checked against `max_batch` before anything is allocated.
Expected<data::Batch> parseInferRequest(std::string_view body, const data::BatchSpec& spec, int64_t max_batch,
                                        std::string* request_id);

// The body of an infer request for the samples of `batch` (every input of `spec` but the label),
// as a client would send them: what `kiln data requests` writes.
std::string inferRequestBody(const data::Batch& batch, const data::BatchSpec& spec);

class InferenceHttpServer {
 public:
  InferenceHttpServer(ModelServer& server, HttpOptions options);
  ~InferenceHttpServer();
  // Binds the socket; returns the port.
  Expected<int> bind();
  // Serves until stop(); returns when every accepted request is answered.
  void run();
  void stop();

 private:
  ModelServer& server_;
  HttpOptions options_;
  std::unique_ptr<httplib::Server> http_;
};

}  // namespace kiln::cli
