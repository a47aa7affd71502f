// The connection handling of `kiln serve` (docs/serving.md, "Connections"): what stands between
// the network and the HTTP library's routing. cpp-httplib 0.11 gives each connection a thread
// for its whole life, bounds a header line's wait but not the headers' (a client sending a
// header line every few seconds holds a thread forever), applies --max-request-bytes to a
// Content-Length only (a chunked or a gzip body is read whole, however large) and queues
// connections past its threads without bound. Here instead:
//
// - one poller thread waits on every connection that has no complete request head yet (idle
//   keep-alive connections, slow clients), so those hold no worker;
// - a worker takes a connection once its request head is whole, checks the framing (the
//   Content-Length and Transfer-Encoding rules that keep requests from being smuggled), reads the
//   body within --body-timeout-ms, de-chunks and inflates it with the decoded size bounded while
//   it is read, and hands the request, whole and plainly framed, to the handler;
// - connections past --max-connections get 503 at once; SIGTERM closes the connections that
//   wait for a request, and those whose request is whole are answered first.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace kiln::cli {

struct ConnectionLimits {
  int workers = 16;                // requests handled at once (their bodies read, then answered)
  int max_connections = 256;       // open at once; more get 503
  int64_t max_body_bytes = 16 << 20;  // the body, decoded (de-chunked and inflated)
  int idle_timeout_ms = 5000;      // no byte of a next request for this long: closed
  int header_timeout_ms = 5000;    // from a request's first byte to the end of its head
  int body_timeout_ms = 10000;     // from the end of the head to the end of the body
  int write_timeout_ms = 5000;     // an answer not taken by the client within this: closed
};

// A request as the handler gets it: the request line and headers (CRLF-terminated, the blank
// line included) with the body's framing replaced by `Content-Length: <decoded size>`, and the
// decoded body.
struct FramedRequest {
  std::string head;
  std::string body;
  bool close = false;  // the connection closes after the answer (so the answer must say so)
};

// Parses and checks a request head (from the request line to the blank line, CRLF or LF line
// ends) and its body's framing. On success `out` holds the head to hand on (less the framing
// headers) and the framing; on failure returns the HTTP status and sets `error`.
struct BodyFraming {
  bool chunked = false;
  uint64_t length = 0;        // Content-Length, when not chunked
  int encoding = 0;           // 0 identity, 1 gzip, 2 deflate (zlib)
  bool expect_continue = false;
  bool close = false;         // HTTP/1.0 without keep-alive, or Connection: close
};
int parseRequestHead(std::string_view head, int64_t max_body_bytes, std::string& forwarded, BodyFraming& framing,
                     std::string& error);

// The chunked transfer coding, decoded as bytes arrive: feed() consumes what it can of `in`
// (returns how much), appending the data to `out`. Chunk-size lines and trailers are bounded.
class ChunkedDecoder {
 public:
  enum class State { NeedMore, Done, Malformed, TooLarge };
  explicit ChunkedDecoder(int64_t max_bytes) : max_bytes_(max_bytes) {}
  size_t feed(std::string_view in, std::string& out);
  State state() const { return state_; }
  const std::string& error() const { return error_; }

 private:
  enum class Phase { Size, Data, DataEnd, Trailer };
  State fail(std::string why);
  int64_t max_bytes_;
  Phase phase_ = Phase::Size;
  State state_ = State::NeedMore;
  uint64_t remaining_ = 0;  // of the current chunk
  uint64_t decoded_ = 0;    // the sizes of the chunks so far
  std::string line_;        // a size or trailer line so far
  int64_t trailer_bytes_ = 0;
  std::string error_;
};

// Inflates a gzip (`encoding` 1) or zlib (2) body into `out`, stopping as soon as it would pass
// `max_bytes`. Returns 0, 413 (too large) or 400 (not valid data), with `error` set.
int inflateBounded(std::string_view in, int encoding, int64_t max_bytes, std::string& out, std::string& error);

class ConnectionPool {
 public:
  // Answers one request on `fd` (the answer written whole before it returns); false when the
  // connection must close (the write failed, or the request asked for it).
  using Handler = std::function<bool(int fd, FramedRequest& request)>;
  ConnectionPool(ConnectionLimits limits, Handler handler);
  ~ConnectionPool();
  // Takes an accepted connection (from the accept loop).
  void adopt(int fd);
  // Stops: connections waiting for a request are closed (a head already whole is still
  // answered), workers finish the requests they hold, answering with Connection: close.
  void stop();
  // Waits for the workers and the poller after stop().
  void join();

 private:
  struct Conn;
  using Clock = std::chrono::steady_clock;
  void pollLoop();
  void workerLoop();
  // Reads what has arrived; true when `c` is to be kept (and its head is whole in `ready`).
  bool receiveHead(Conn& c, bool& ready);
  // Answers one request of `c`; true when the connection may wait for another.
  bool serve(std::unique_ptr<Conn>& c);
  void toPoller(std::unique_ptr<Conn> c);
  // Writes a short error answer and hands the connection to the poller to be drained and closed
  // (closing a socket with unread input resets it, and the client may never read the answer).
  // `wait`: whether to wait up to the write timeout for the client to take it (the poller and
  // the accept loop must not wait on one client).
  void refuse(std::unique_ptr<Conn> c, int status, const std::string& message, bool wait);
  bool writeAll(int fd, std::string_view data, Clock::time_point deadline);
  void closeConn(std::unique_ptr<Conn> c);

  ConnectionLimits limits_;
  Handler handler_;
  int wake_[2] = {-1, -1};  // a pipe that wakes the poller
  std::mutex mu_;
  std::condition_variable ready_cv_;
  std::deque<std::unique_ptr<Conn>> to_poll_;  // handed to the poller
  std::deque<std::unique_ptr<Conn>> ready_;    // heads whole, for the workers
  int open_ = 0;                               // connections held (not lingering)
  int lingering_ = 0;                          // answered, being drained before close
  bool stopping_ = false;
  bool poller_done_ = false;  // stopped: no more connections come to the workers
  std::thread poller_;
  std::vector<std::thread> workers_;
};

}  // namespace kiln::cli
