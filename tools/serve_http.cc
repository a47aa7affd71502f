#include "tools/serve_http.h"

#include <arpa/inet.h>
#include <fmt/ranges.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "runtime/json.h"
#include "tools/cli.h"
#include "tools/http_connections.h"

namespace kiln::cli {
namespace {

using json::Json;

const char* datatypeOf(ir::DType t) {
  switch (t) {
    case ir::DType::f32:
      return "FP32";
    case ir::DType::i32:
      return "INT32";
    case ir::DType::i64:
      return "INT64";
    default:
      return "BYTES";
  }
}

// Appends the numbers of `v` (nested arrays flattened, row-major) to `out`, at most `limit`, and
// where each is to `nodes` (a message quotes the number as sent: an id of 2^64 - 1 is not exact as
// a double, and 2^63 or more cast to int64 printed as -9223372036854775808).
Status flatten(const Json& v, std::vector<double>& out, std::vector<const Json*>& nodes, size_t limit,
               int depth) {
  if (v.is_array()) {
    if (depth > 8) return Status::error("data is nested too deeply");
    for (const Json& x : v) KILN_RETURN_IF_ERROR(flatten(x, out, nodes, limit, depth + 1));
    return Status::ok();
  }
  if (!v.is_number()) return Status::errorf("data holds {}, not a number", v.type_name());
  if (out.size() >= limit) return Status::errorf("data holds more than the {} values its shape has", limit);
  out.push_back(v.get<double>());
  nodes.push_back(&v);
  return Status::ok();
}

// What one input of the spec looks like in a request of n samples (`flat_ids`: the ids of its
// feature, when it lies flat).
std::vector<int64_t> expectedShape(const data::InputSpec& in, int64_t n, int64_t flat_ids) {
  if (driver::liesFlat(in)) return {flat_ids};
  std::vector<int64_t> shape{n};
  for (size_t d = 1; d < in.type.shape().size(); ++d)
    shape.push_back(in.type.dim(static_cast<int64_t>(d)).size());
  return shape;
}

Json error(const std::string& message) { return Json{{"error", message}}; }

// JSON text of a reply. A message may quote the request's bytes (a JSON syntax error quotes what
// it read): bytes that are not UTF-8 become U+FFFD rather than an exception (a 500).
std::string replyText(const Json& body) { return body.dump(-1, ' ', false, Json::error_handler_t::replace); }

// A model version as a path names it: a whole number (Triton's are int64), leading zeros allowed.
std::optional<int64_t> parseVersion(const std::string& text) {
  if (text.empty() || text.size() > 18) return std::nullopt;
  int64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  return v;
}

// The body of a repository request: empty (tritonclient sends none to the index) or an object.
Expected<Json> optionalObject(const std::string& body) {
  if (body.empty()) return Json::object();
  KILN_ASSIGN_OR_RETURN(Json j, json::parse(body));
  if (!j.is_object()) return Status::error("the request body must be a JSON object");
  return j;
}

Json metadataBody(const driver::ModelServer& server) {
  Json inputs = Json::array();
  for (const data::InputSpec& in : server.spec().inputs) {
    std::vector<int64_t> shape = expectedShape(in, -1, -1);
    Json one{{"name", in.name}, {"datatype", datatypeOf(in.type.dtype())}, {"shape", shape}};
    if (in.role == data::InputRole::Label) one["optional"] = true;
    if (in.role == data::InputRole::Sparse) one["rows"] = in.rows;
    inputs.push_back(std::move(one));
  }
  std::vector<int64_t> out_shape{-1};
  if (server.tasks() > 1) out_shape.push_back(static_cast<int64_t>(server.tasks()));
  return Json{
      {"name", server.modelName()},
      {"versions", Json::array({std::to_string(server.version())})},
      {"platform", "kiln"},
      {"max_batch_size", server.options().max_batch},
      {"inputs", inputs},
      {"outputs", Json::array({Json{{"name", "score"}, {"datatype", "FP32"}, {"shape", out_shape}}})}};
}

// The model configuration extension: the metadata in the form of Triton's model config, where
// dims leave out the batch dim, a [batch] tensor is dims [1] reshaped to [], and the flat ids of a
// variable-length feature are a ragged batch.
Json configBody(const driver::ModelServer& server) {
  auto configType = [](ir::DType t) {
    return t == ir::DType::f32 ? "TYPE_FP32" : t == ir::DType::i32 ? "TYPE_INT32" : "TYPE_INT64";
  };
  auto perSample = [](Json& one, std::vector<int64_t> dims) {
    if (dims.empty()) {
      one["dims"] = std::vector<int64_t>{1};
      one["reshape"] = Json{{"shape", Json::array()}};
    } else {
      one["dims"] = dims;
    }
  };
  Json inputs = Json::array();
  for (const data::InputSpec& in : server.spec().inputs) {
    Json one{{"name", in.name}, {"data_type", configType(in.type.dtype())}};
    if (driver::liesFlat(in)) {
      one["dims"] = std::vector<int64_t>{-1};
      one["allow_ragged_batch"] = true;
    } else {
      std::vector<int64_t> shape = expectedShape(in, -1, -1);
      perSample(one, std::vector<int64_t>(shape.begin() + 1, shape.end()));
    }
    if (in.role == data::InputRole::Label) one["optional"] = true;
    inputs.push_back(std::move(one));
  }
  Json output{{"name", "score"}, {"data_type", "TYPE_FP32"}};
  perSample(output, server.tasks() > 1 ? std::vector<int64_t>{static_cast<int64_t>(server.tasks())}
                                       : std::vector<int64_t>{});
  const driver::ServeOptions& o = server.options();
  return Json{{"name", server.modelName()},
              {"platform", "kiln"},
              {"max_batch_size", o.max_batch},
              {"input", inputs},
              {"output", Json::array({output})},
              {"dynamic_batching", Json{{"preferred_batch_size", o.preferred_batch_sizes},
                                        {"max_queue_delay_microseconds", o.max_queue_delay_us}}},
              {"instance_group", Json::array({Json{{"count", server.instances()}}})}};
}

// The statistics extension: one entry, the served model at its served version.
Json statisticsBody(const driver::ModelServer& server) {
  const driver::InferenceStats s = server.inferenceStats();
  auto duration = [](const driver::InferenceStats::Duration& d) { return Json{{"count", d.count}, {"ns", d.ns}}; };
  Json batches = Json::array();
  for (const auto& [size, b] : s.batches)
    batches.push_back(Json{{"batch_size", size},
                           {"compute_input", duration(b.compute_input)},
                           {"compute_infer", duration(b.compute_infer)},
                           {"compute_output", duration(b.compute_output)}});
  // No response cache: its hits and misses are none, listed as Triton lists them.
  const Json stats{{"success", duration(s.success)},
                   {"fail", duration(s.fail)},
                   {"queue", duration(s.queue)},
                   {"compute_input", duration(s.compute_input)},
                   {"compute_infer", duration(s.compute_infer)},
                   {"compute_output", duration(s.compute_output)},
                   {"cache_hit", duration({})},
                   {"cache_miss", duration({})}};
  const Json model{{"name", server.modelName()},
                   {"version", std::to_string(server.version())},
                   {"last_inference", s.last_inference_ms},
                   {"inference_count", s.inference_count},
                   {"execution_count", s.execution_count},
                   {"inference_stats", stats},
                   {"batch_stats", batches},
                   {"memory_usage", Json::array()}};
  return Json{{"model_stats", Json::array({model})}};
}

// The range of values a request's integer `datatype` holds (as doubles: exact at these bounds).
bool inDatatypeRange(const std::string& datatype, double v, double& lo, double& hi) {
  if (datatype == "INT8") {
    lo = -128, hi = 127;
  } else if (datatype == "INT16") {
    lo = -32768, hi = 32767;
  } else if (datatype == "INT32") {
    lo = -2147483648.0, hi = 2147483647.0;
  } else if (datatype == "UINT32") {
    lo = 0, hi = 4294967295.0;
  } else if (datatype == "UINT64") {
    lo = 0, hi = 18446744073709549568.0;  // the largest double below 2^64
  } else {
    lo = -9223372036854775808.0, hi = 9223372036854774784.0;  // INT64: the largest double below 2^63
  }
  return v >= lo && v <= hi;
}

// An httplib::Stream over one request that the connection pool has read whole (the head, then
// the decoded body, from memory); the answer goes to the socket, within the write timeout.
class PooledRequestStream final : public httplib::Stream {
 public:
  PooledRequestStream(int fd, const FramedRequest& request, int write_timeout_ms)
      : fd_(fd), head_(request.head), body_(request.body), write_timeout_ms_(write_timeout_ms) {}
  bool failed() const { return failed_; }

  bool is_readable() const override { return true; }
  bool is_writable() const override { return !failed_; }
  ssize_t read(char* ptr, size_t size) override {
    std::string_view& from = head_.empty() ? body_ : head_;
    const size_t n = std::min(size, from.size());
    std::memcpy(ptr, from.data(), n);
    from.remove_prefix(n);
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    // The timeout runs from the answer's first byte: computing it may take the request timeout.
    if (!started_) {
      deadline_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(write_timeout_ms_);
      started_ = true;
    }
    size_t done = 0;
    while (done < size && !failed_) {
      const ssize_t n = ::send(fd_, ptr + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        done += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ -
                                                                              std::chrono::steady_clock::now());
      if ((n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) || left.count() <= 0) {
        failed_ = true;
        break;
      }
      pollfd p{fd_, POLLOUT, 0};
      ::poll(&p, 1, static_cast<int>(left.count()));
    }
    return failed_ ? -1 : static_cast<ssize_t>(size);
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return fd_; }

 private:
  void address(bool peer, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    if ((peer ? ::getpeername(fd_, reinterpret_cast<sockaddr*>(&a), &len)
              : ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len)) != 0)
      return;
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof(host), serv, sizeof(serv),
                      NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      port = std::atoi(serv);
    }
  }
  int fd_;
  std::string_view head_, body_;
  int write_timeout_ms_;
  bool started_ = false, failed_ = false;
  std::chrono::steady_clock::time_point deadline_;
};

// Runs the accept loop's task on the accept thread: the task hands the socket to the pool.
class HandOver final : public httplib::TaskQueue {
 public:
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override {}
};

// Why binding `host:port` fails, from a bind of our own (httplib's bind keeps errno to itself).
std::string bindFailure(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || !found)
    return "not an address of this machine";
  int err = 0;
  const int fd = ::socket(found->ai_family, found->ai_socktype, found->ai_protocol);
  if (fd >= 0) {
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (::bind(fd, found->ai_addr, found->ai_addrlen) != 0 || ::listen(fd, 1) != 0) err = errno;
    ::close(fd);
  } else {
    err = errno;
  }
  ::freeaddrinfo(found);
  if (err == EADDRINUSE) return "the port is in use (by another kiln serve?)";
  if (err == EADDRNOTAVAIL) return "not an address of this machine";
  if (err == EACCES) return "permission denied (ports below 1024 need privileges)";
  return err ? std::strerror(err) : "in use, or not an address of this machine";
}

}  // namespace

// cpp-httplib's server, its connections handled by a ConnectionPool: the accept loop hands each
// socket over, and the pool hands each whole request to httplib's request processing (routing,
// handlers, the answer).
class KilnHttpServer final : public httplib::Server {
 public:
  explicit KilnHttpServer(const ConnectionLimits& limits)
      : write_timeout_ms_(limits.write_timeout_ms),
        pool_(limits, [this](int fd, FramedRequest& r) { return answer(fd, r); }) {
    new_task_queue = [] { return new HandOver(); };
  }
  ConnectionPool& pool() { return pool_; }
  // Closes the listening socket, which ends the accept loop or keeps it from starting: unlike
  // httplib::Server::stop(), also before listen_after_bind() has begun (a SIGTERM at start).
  void closeListener() {
    const socket_t sock = svr_sock_.exchange(INVALID_SOCKET);
    if (sock != INVALID_SOCKET) {
      ::shutdown(sock, SHUT_RDWR);
      ::close(sock);
    }
  }

 private:
  bool process_and_close_socket(socket_t sock) override {
    pool_.adopt(sock);
    return true;
  }
  bool answer(int fd, FramedRequest& request) {
    PooledRequestStream stream(fd, request, write_timeout_ms_);
    bool closed = false;
    const bool ok = process_request(stream, request.close, closed, nullptr);
    return ok && !closed && !stream.failed();
  }
  int write_timeout_ms_;
  ConnectionPool pool_;
};

Expected<data::Batch> parseInferRequest(std::string_view body, const data::BatchSpec& spec, int64_t max_batch,
                                        std::string* request_id) {
  KILN_ASSIGN_OR_RETURN(Json req, json::parse(body));
  if (!req.is_object()) return Status::error("the request body must be a JSON object");
  if (auto it = req.find("id"); it != req.end() && it->is_string() && request_id)
    *request_id = it->get<std::string>();
  auto inputs = req.find("inputs");
  if (inputs == req.end() || !inputs->is_array()) return Status::error("the request has no \"inputs\" array");
  if (spec.readsTokens())
    return Status::error("this model reads tokens; kiln serve serves per-sample scores");
  // Each request input by name, checked for form.
  std::map<std::string, const Json*> given;
  for (const Json& in : *inputs) {
    if (!in.is_object()) return Status::error("each of \"inputs\" must be an object");
    auto name = in.find("name");
    if (name == in.end() || !name->is_string()) return Status::error("an input has no \"name\"");
    const std::string n = name->get<std::string>();
    if (!spec.find(n)) return Status::errorf("the model has no input '{}'", n);
    if (!given.emplace(n, &in).second) return Status::errorf("input '{}' is given twice", n);
  }
  // The shapes first: n samples, and the flat ids of variable-length features.
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& [name, in] : given) {
    auto shape = in->find("shape");
    if (shape == in->end() || !shape->is_array() || shape->empty() || shape->size() > 4)
      return Status::errorf("input '{}' needs a \"shape\" of 1 to 4 dims", name);
    std::vector<int64_t> s;
    for (const Json& d : *shape) {
      auto v = json::asInt64(d);
      if (!v || *v < 0)
        return Status::errorf("input '{}': shape {} must hold sizes >= 0", name, shape->dump());
      s.push_back(*v);
    }
    shapes[name] = s;
  }
  int64_t n = -1;
  for (const data::InputSpec& in : spec.inputs) {
    if (driver::liesFlat(in) || !shapes.count(in.name)) continue;
    const int64_t rows = shapes[in.name][0];
    if (n >= 0 && rows != n)
      return Status::errorf("input '{}' holds {} samples but another input {}", in.name, rows, n);
    n = rows;
  }
  if (n < 0) return Status::error("no input says how many samples the request holds");
  if (n < 1) return Status::error("the request holds no samples");
  if (n > max_batch) return Status::errorf("the request holds {} samples, over --max-batch {}", n, max_batch);

  data::Batch batch;
  batch.size = n;
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const data::InputSpec& in = spec.inputs[i];
    batch.names.push_back(in.name);
    auto it = given.find(in.name);
    if (it == given.end()) {
      if (in.role != data::InputRole::Label) return Status::errorf("input '{}' is missing", in.name);
      std::vector<int64_t> shape = expectedShape(in, n, 0);
      batch.tensors.emplace_back(in.type.dtype(), shape);
      std::memset(batch.tensors.back().view.data, 0, static_cast<size_t>(batch.tensors.back().view.bytes()));
      continue;
    }
    const Json& j = *it->second;
    int64_t ids = 0;
    if (in.role == data::InputRole::Sparse && in.variableLength()) {
      ids = shapes[in.name][0];
      if (ids > n * in.max_hotness)
        return Status::errorf("input '{}' holds {} ids, over {} samples of at most {}", in.name, ids, n,
                              in.max_hotness);
    } else if (driver::liesFlat(in)) {
      // Flat weights: one per id of their feature.
      for (const data::InputSpec& s : spec.inputs)
        if (s.role == data::InputRole::Sparse && s.weights_input == static_cast<int>(i))
          ids = shapes.count(s.name) ? shapes[s.name][0] : 0;
    }
    const std::vector<int64_t> want = expectedShape(in, n, ids);
    if (shapes[in.name] != want)
      return Status::errorf("input '{}' must be shaped [{}], got [{}]", in.name, fmt::join(want, ", "),
                            fmt::join(shapes[in.name], ", "));
    auto datatype_at = j.find("datatype");
    if (datatype_at == j.end() || !datatype_at->is_string())
      return Status::errorf("input '{}' needs a \"datatype\" string ({}), got {}", in.name,
                            datatypeOf(in.type.dtype()),
                            datatype_at == j.end() ? std::string("none") : replyText(*datatype_at));
    const std::string datatype = datatype_at->get<std::string>();
    const bool integer = ir::isInteger(in.type.dtype());
    const bool ok = integer ? (datatype == "INT64" || datatype == "INT32" || datatype == "UINT32" ||
                               datatype == "UINT64" || datatype == "INT16" || datatype == "INT8")
                            : (datatype == "FP32" || datatype == "FP64");
    if (!ok)
      return Status::errorf("input '{}' must be of datatype {}, got \"{}\"", in.name,
                            datatypeOf(in.type.dtype()), datatype);
    int64_t count = 1;
    for (int64_t d : want) count *= d;
    auto data = j.find("data");
    if (data == j.end()) return Status::errorf("input '{}' has no \"data\"", in.name);
    std::vector<double> values;
    std::vector<const Json*> nodes;
    values.reserve(static_cast<size_t>(count));
    nodes.reserve(static_cast<size_t>(count));
    if (Status st = flatten(*data, values, nodes, static_cast<size_t>(count), 0); !st)
      return Status::errorf("input '{}': {}", in.name, st.message());
    if (static_cast<int64_t>(values.size()) != count)
      return Status::errorf("input '{}' has {} values; its shape [{}] needs {}", in.name, values.size(),
                            fmt::join(want, ", "), count);
    ir::HostTensor t(in.type.dtype(), want);
    for (int64_t k = 0; k < count; ++k) {
      const double v = values[static_cast<size_t>(k)];
      if (integer) {
        const std::string sent = replyText(*nodes[static_cast<size_t>(k)]);
        if (v != std::floor(v) || !std::isfinite(v))
          return Status::errorf("input '{}': value {} at position {} is not an integer", in.name, sent, k);
        double lo = 0, hi = 0;
        if (!inDatatypeRange(datatype, v, lo, hi))
          return Status::errorf(
              "input '{}': value {} at position {} is out of the range of {} [{:.0f}, {:.0f}]", in.name, sent,
              k, datatype, lo, hi);
        if (in.type.dtype() == ir::DType::i32 && (v < -2147483648.0 || v > 2147483647.0))
          return Status::errorf(
              "input '{}': value {} at position {} is out of the range of the input's int32", in.name, sent,
              k);
        if (in.role == data::InputRole::Sparse && (v < 0 || v >= static_cast<double>(in.rows)))
          return Status::errorf("input '{}': id {} at position {} is out of range [0, {})", in.name, sent, k,
                                in.rows);
        if (in.role == data::InputRole::Lengths && (v < 0 || v > std::numeric_limits<int32_t>::max()))
          return Status::errorf("input '{}': length {} at position {} is out of range", in.name, sent, k);
        if (in.type.dtype() == ir::DType::i32)
          t.view.as<int32_t>()[k] = static_cast<int32_t>(v);
        else
          t.view.as<int64_t>()[k] = static_cast<int64_t>(v);
      } else {
        // JSON has no NaN or infinity, but 1e400 reads as an infinite double and 1e40 as an
        // infinite float: a score from either is meaningless (the file readers refuse them too).
        const float f = static_cast<float>(v);
        if (!std::isfinite(f))
          return Status::errorf("input '{}': value {} at position {} is not a finite float32", in.name, v, k);
        t.view.as<float>()[k] = f;
      }
    }
    batch.tensors.push_back(std::move(t));
  }
  // Variable-length features: lengths within the bound and summing to the ids given.
  for (size_t i = 0; i < spec.inputs.size(); ++i) {
    const data::InputSpec& in = spec.inputs[i];
    if (in.role != data::InputRole::Sparse || !in.variableLength()) continue;
    const ir::TensorView& lengths = batch.tensors[static_cast<size_t>(in.lengths_input)].view;
    int64_t total = 0;
    for (int64_t b = 0; b < n; ++b) {
      const int64_t len = lengths.as<int32_t>()[b];
      if (len > in.max_hotness)
        return Status::errorf("input '{}': sample {} has {} ids, over the feature's {}",
                              spec.inputs[static_cast<size_t>(in.lengths_input)].name, b, len,
                              in.max_hotness);
      total += len;
    }
    if (total != batch.tensors[i].view.shape[0])
      return Status::errorf("input '{}' holds {} ids but its lengths sum to {}", in.name,
                            batch.tensors[i].view.shape[0], total);
  }
  return batch;
}

std::string inferRequestBody(const data::Batch& batch, const data::BatchSpec& spec) {
  Json inputs = Json::array();
  for (size_t i = 0; i < spec.inputs.size() && i < batch.tensors.size(); ++i) {
    const data::InputSpec& in = spec.inputs[i];
    if (in.role == data::InputRole::Label) continue;
    const ir::TensorView& v = batch.tensors[i].view;
    Json values = Json::array();
    for (int64_t k = 0, n = v.numel(); k < n; ++k) {
      switch (v.dtype) {
        case ir::DType::f32:
          values.push_back(v.as<float>()[k]);
          break;
        case ir::DType::i32:
          values.push_back(v.as<int32_t>()[k]);
          break;
        default:
          values.push_back(v.as<int64_t>()[k]);
          break;
      }
    }
    inputs.push_back(
        Json{{"name", in.name}, {"shape", v.shape}, {"datatype", datatypeOf(v.dtype)}, {"data", values}});
  }
  return Json{{"inputs", inputs}}.dump();
}

InferenceHttpServer::InferenceHttpServer(driver::ModelServer& server, HttpOptions options)
    : server_(server), options_(std::move(options)) {
  ConnectionLimits limits;
  limits.workers = std::max(options_.threads, 2);
  limits.max_connections = options_.max_connections;
  limits.max_body_bytes = options_.max_request_bytes;
  limits.idle_timeout_ms = options_.idle_timeout_ms;
  limits.header_timeout_ms = options_.header_timeout_ms;
  limits.body_timeout_ms = options_.body_timeout_ms;
  http_ = std::make_unique<KilnHttpServer>(limits);
  httplib::Server& h = *http_;
  // The pool has read and decoded each body within the limit already; this is a second fence.
  h.set_payload_max_length(static_cast<size_t>(options_.max_request_bytes));
  // What the Keep-Alive header of an answer says (the pool closes idle connections).
  h.set_keep_alive_timeout(std::max(options_.idle_timeout_ms / 1000, 1));
  h.set_keep_alive_max_count(std::numeric_limits<int>::max());
  // SO_REUSEADDR alone: a restarted server binds while its old connections sit in TIME_WAIT, but
  // a second server on a port in use fails (httplib's default adds SO_REUSEPORT, with which
  // both would listen and the kernel would split the connections between them).
  h.set_socket_options([](socket_t sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });

  auto reply = [](httplib::Response& res, int status, const Json& body) {
    res.status = status;
    res.set_content(replyText(body), "application/json");
  };
  const std::string model = server_.modelName();
  // The model a path names (matches[1]) and, in a /versions/V path, its version (matches[2]) must
  // be the served ones; otherwise the answer says why (404, or 400 for a version not a number).
  // `version`: the one named, or -1.
  auto resolve = [this, model, reply](const httplib::Request& req, httplib::Response& res, int64_t& version) {
    version = -1;
    const std::string name = req.matches[1];
    if (name != model) {
      reply(res, 404, error(fmt::format("unknown model '{}'; this server serves '{}'", name, model)));
      return false;
    }
    if (req.matches.size() < 3 || !req.matches[2].matched) return true;
    const std::string asked = req.matches[2];
    const std::optional<int64_t> v = parseVersion(asked);
    if (!v) {
      reply(res, 400, error(fmt::format("model version '{}' is not a whole number", asked)));
      return false;
    }
    const int64_t served = server_.version();
    if (*v != served) {
      reply(res, 404,
            error(fmt::format("model '{}' has no version '{}'; this server serves version {}", model, asked,
                              served)));
      return false;
    }
    version = *v;
    return true;
  };
  // Every model route takes an optional /versions/V after the name.
  auto modelPath = [](const char* rest) {
    return fmt::format(R"(/v2/models/([^/]+)(?:/versions/([^/]+))?{})", rest);
  };

  h.Get("/v2/health/live", [reply](const httplib::Request&, httplib::Response& res) {
    reply(res, 200, Json{{"live", true}});
  });
  h.Get("/v2/health/ready", [this, reply](const httplib::Request&, httplib::Response& res) {
    reply(res, server_.ready() ? 200 : 503, Json{{"ready", server_.ready()}});
  });
  h.Get("/v2", [this, reply](const httplib::Request&, httplib::Response& res) {
    reply(res, 200,
          Json{{"name", "kiln"},
               {"version", options_.version},
               {"extensions", Json::array({"model_repository", "model_configuration", "statistics"})}});
  });
  // Before the metadata route, which would take "stats" for a model name.
  h.Get("/v2/models/stats", [this, reply](const httplib::Request&, httplib::Response& res) {
    reply(res, 200, statisticsBody(server_));
  });
  h.Get(modelPath("/stats"), [this, reply, resolve](const httplib::Request& req, httplib::Response& res) {
    int64_t version;
    if (resolve(req, res, version)) reply(res, 200, statisticsBody(server_));
  });
  h.Get(modelPath("/ready"), [this, reply, resolve](const httplib::Request& req, httplib::Response& res) {
    int64_t version;
    if (!resolve(req, res, version)) return;
    reply(res, server_.ready() ? 200 : 503, Json{{"name", server_.modelName()}, {"ready", server_.ready()}});
  });
  h.Get(modelPath("/config"), [this, reply, resolve](const httplib::Request& req, httplib::Response& res) {
    int64_t version;
    if (resolve(req, res, version)) reply(res, 200, configBody(server_));
  });
  h.Get(modelPath(""), [this, reply, resolve](const httplib::Request& req, httplib::Response& res) {
    int64_t version;
    if (resolve(req, res, version)) reply(res, 200, metadataBody(server_));
  });
  h.Post(modelPath("/infer"), [this, reply, resolve](const httplib::Request& req, httplib::Response& res) {
    const auto start = std::chrono::steady_clock::now();
    auto finish = [&](int status, const Json& body) {
      reply(res, status, body);
      const auto took = std::chrono::steady_clock::now() - start;
      server_.noteRequest(status, std::chrono::duration<double>(took).count());
      server_.noteInference(status == 200, std::chrono::duration_cast<std::chrono::nanoseconds>(took));
    };
    int64_t version;
    if (!resolve(req, res, version)) {
      server_.noteRequest(res.status, 0);
      return;
    }
    if (req.has_header("Inference-Header-Content-Length"))
      return finish(400, error("the binary tensor extension (Inference-Header-Content-Length) is not "
                               "supported: send each input's values as JSON \"data\""));
    std::string id;
    auto batch = parseInferRequest(req.body, server_.spec(), server_.options().max_batch, &id);
    if (!batch) return finish(400, error(batch.status().message()));
    const int64_t n = batch->size;
    driver::InferOutcome out = server_.infer(batch.take(), version);
    if (out.status != 200) return finish(out.status, error(out.error));
    std::vector<int64_t> shape{n};
    if (server_.tasks() > 1) shape.push_back(static_cast<int64_t>(server_.tasks()));
    Json body{{"model_name", server_.modelName()}, {"model_version", std::to_string(out.version)}};
    if (!id.empty()) body["id"] = id;
    body["outputs"] =
        Json::array({Json{{"name", "score"}, {"datatype", "FP32"}, {"shape", shape}, {"data", out.scores}}});
    finish(200, body);
  });
  // The model repository extension: the one model, fixed at start, is listed and stays loaded.
  h.Post("/v2/repository/index", [this, reply](const httplib::Request& req, httplib::Response& res) {
    auto body = optionalObject(req.body);
    if (!body) return reply(res, 400, error(body.status().message()));
    bool ready_only = false;
    if (auto it = body->find("ready"); it != body->end()) {
      if (!it->is_boolean()) return reply(res, 400, error("\"ready\" must be true or false"));
      ready_only = it->get<bool>();
    }
    const bool ready = server_.ready();
    Json models = Json::array();
    if (ready || !ready_only) {
      Json one{{"name", server_.modelName()},
               {"version", std::to_string(server_.version())},
               {"state", ready ? "READY" : "UNAVAILABLE"}};
      if (!ready) one["reason"] = "the server is shutting down";
      models.push_back(std::move(one));
    }
    reply(res, 200, models);
  });
  h.Post(R"(/v2/repository/models/([^/]+)/load)",
         [this, model, reply](const httplib::Request& req, httplib::Response& res) {
           const std::string name = req.matches[1];
           if (name != model)
             return reply(res, 404,
                          error(fmt::format("kiln serve serves one model, fixed at start ('{}'): it cannot "
                                            "load '{}'",
                                            model, name)));
           auto body = optionalObject(req.body);
           if (!body) return reply(res, 400, error(body.status().message()));
           // A config or files to load from: the model was compiled at start and is not reloaded.
           if (auto it = body->find("parameters"); it != body->end() && !(it->is_object() && it->empty()))
             return reply(res, 501,
                          error(fmt::format("kiln serve cannot reload '{}' with parameters (a config or "
                                            "files): restart it with the new model or checkpoint",
                                            model)));
           if (!server_.ready()) return reply(res, 503, error("the server is shutting down"));
           // Loaded since start: loading it again leaves it as it is.
           reply(res, 200, Json::object());
         });
  h.Post(R"(/v2/repository/models/([^/]+)/unload)", [model, reply](const httplib::Request& req,
                                                                   httplib::Response& res) {
    const std::string name = req.matches[1];
    if (name != model)
      return reply(res, 404, error(fmt::format("unknown model '{}'; this server serves '{}'", name, model)));
    reply(res, 501,
          error(fmt::format("kiln serve serves '{}' until it exits: it cannot unload it (stop the "
                            "server with SIGTERM instead)",
                            model)));
  });
  h.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(server_.metricsText(), "text/plain; version=0.0.4");
  });
  h.set_exception_handler([reply](const httplib::Request&, httplib::Response& res, std::exception_ptr e) {
    reply(res, 500, error(uncaughtExceptionMessage(e)));
  });
  h.set_error_handler([reply](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    // A client of the protocol may call extensions kiln serve lacks (trace, logging, shared memory):
    // the message says which call and where the implemented ones are listed.
    std::string why = res.status == 413   ? "the request body is over --max-request-bytes"
                      : res.status >= 500 ? "internal error"
                                          : "bad request";
    if (res.status == 404) {
      why = fmt::format("no such endpoint: {} {}", req.method, req.path);
      if (req.path.rfind("/v2/", 0) == 0)
        why += " (GET /v2 lists the protocol extensions kiln serve implements)";
    }
    reply(res, res.status, error(why));
  });
}

InferenceHttpServer::~InferenceHttpServer() = default;

Expected<int> InferenceHttpServer::bind() {
  int port = options_.port == 0 ? http_->bind_to_any_port(options_.host)
                                : (http_->bind_to_port(options_.host, options_.port) ? options_.port : -1);
  if (port < 0)
    return Status::errorf("cannot listen on {}:{}: {}", options_.host, options_.port,
                          bindFailure(options_.host, options_.port));
  return port;
}

void InferenceHttpServer::run() {
  http_->listen_after_bind();
  // The accept loop has ended (stop()); the pool answers the requests it holds whole.
  http_->pool().stop();
  http_->pool().join();
}

void InferenceHttpServer::stop() {
  http_->pool().stop();        // connections waiting for a request close now
  http_->closeListener();      // and no new ones are accepted
}

}  // namespace kiln::cli
