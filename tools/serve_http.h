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
#include "driver/model_server.h"

namespace kiln::cli {

class KilnHttpServer;

struct HttpOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (the bound one is printed)
  int64_t max_request_bytes = 16 << 20;  // the body once de-chunked and inflated
  int threads = 16;                      // requests read and answered at once
  int max_connections = 256;             // open at once; more get 503
  int idle_timeout_ms = 5000;            // a connection with no request arriving is closed
  int header_timeout_ms = 5000;          // a request's line and headers, from its first byte
  int body_timeout_ms = 10000;           // its body, from the end of its headers
  std::string version;                   // of Kiln, for GET /v2
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
  InferenceHttpServer(driver::ModelServer& server, HttpOptions options);
  ~InferenceHttpServer();
  // Binds the socket; returns the port.
  Expected<int> bind();
  // Serves until stop(); returns when every request received whole is answered.
  void run();
  // Stops accepting; closes the connections that wait for a request (idle, or their headers
  // incomplete); those whose request is whole are answered, then closed. Bodies being read get
  // the rest of --body-timeout-ms.
  void stop();

 private:
  driver::ModelServer& server_;
  HttpOptions options_;
  std::unique_ptr<KilnHttpServer> http_;
};

}  // namespace kiln::cli
