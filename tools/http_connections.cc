#include "tools/http_connections.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstring>

#include "runtime/json.h"

namespace kiln::cli {
namespace {

// The most a request line and its headers may take (nginx's large_client_header_buffers: 4 x 8k).
constexpr size_t kMaxHeadBytes = 32 << 10;
// A chunk-size line (with its extensions), and a trailer section.
constexpr size_t kMaxChunkLine = 1024;
constexpr int64_t kMaxTrailerBytes = 16 << 10;
// How long an answered error waits for the client's unread input before the socket closes.
constexpr int kLingerMs = 2000;
constexpr size_t kReadChunk = 64 << 10;

char lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

bool iequals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (lower(a[i]) != lower(b[i])) return false;
  return true;
}

std::string lowered(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = lower(c);
  return out;
}

// RFC 9110's token characters (header names, methods).
bool isTokenChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
         std::strchr("!#$%&'*+-.^_`|~", c) != nullptr;
}

std::string_view trimOws(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// A header's text for a message, its bytes outside printable ASCII escaped.
std::string printable(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 80)) {
    const auto u = static_cast<unsigned char>(c);
    out += (u >= 0x20 && u < 0x7f) ? std::string(1, c) : fmt::format("\\x{:02x}", u);
  }
  if (s.size() > 80) out += "...";
  return out;
}

// Whether a comma-separated header value lists `token`.
bool listsToken(std::string_view value, std::string_view token) {
  while (!value.empty()) {
    const size_t comma = value.find(',');
    if (iequals(trimOws(value.substr(0, comma)), token)) return true;
    if (comma == std::string_view::npos) break;
    value.remove_prefix(comma + 1);
  }
  return false;
}

// The end of a request head in `s` (just past its blank line), or npos; `scanned` is where the
// search resumes: the start of the last line not yet whole.
size_t headEnd(std::string_view s, size_t& scanned) {
  size_t pos = scanned;
  for (;;) {
    const size_t nl = s.find('\n', pos);
    if (nl == std::string_view::npos) {
      scanned = pos;
      return std::string_view::npos;
    }
    const size_t len = nl - pos;
    if (pos > 0 && (len == 0 || (len == 1 && s[pos] == '\r'))) return nl + 1;
    pos = nl + 1;
  }
}

// Empty lines before a request line are ignored (RFC 9112, 2.2): some clients send a CRLF after
// a POST body.
void skipEmptyLines(std::string& in, size_t& scanned) {
  size_t skip = 0;
  while (skip < in.size() && (in[skip] == '\r' || in[skip] == '\n')) ++skip;
  if (skip > 0) {
    in.erase(0, skip);
    scanned = 0;
  }
}

const char* reasonPhrase(int status) {
  switch (status) {
    case 400:
      return "Bad Request";
    case 408:
      return "Request Timeout";
    case 413:
      return "Payload Too Large";
    case 415:
      return "Unsupported Media Type";
    case 417:
      return "Expectation Failed";
    case 431:
      return "Request Header Fields Too Large";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return "Error";
  }
}

}  // namespace

int parseRequestHead(std::string_view head, int64_t max_body_bytes, std::string& forwarded, BodyFraming& framing,
                     std::string& error) {
  auto bad = [&](int status, std::string why) {
    error = std::move(why);
    return status;
  };
  std::vector<std::string_view> lines;
  for (size_t pos = 0; pos < head.size();) {
    const size_t nl = head.find('\n', pos);
    std::string_view line = head.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos);
    pos = nl == std::string_view::npos ? head.size() : nl + 1;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) break;
    for (char c : line)
      if (c == '\r' || c == '\0')
        return bad(400, fmt::format("a bare CR or a NUL byte in the request head: '{}'", printable(line)));
    lines.push_back(line);
  }
  if (lines.empty()) return bad(400, "the request has no request line");
  // METHOD SP request-target SP HTTP-version
  const std::string_view request_line = lines[0];
  const size_t sp1 = request_line.find(' '), sp2 = request_line.rfind(' ');
  if (sp1 == std::string_view::npos || sp1 == sp2 || sp1 == 0 || sp2 == sp1 + 1 ||
      request_line.substr(sp1 + 1, sp2 - sp1 - 1).find(' ') != std::string_view::npos)
    return bad(400, fmt::format("malformed request line '{}'", printable(request_line)));
  for (char c : request_line.substr(0, sp1))
    if (!isTokenChar(c)) return bad(400, fmt::format("malformed request line '{}'", printable(request_line)));
  const std::string_view version = request_line.substr(sp2 + 1);
  const bool http10 = version == "HTTP/1.0";
  if (!http10 && version != "HTTP/1.1") {
    if (version.substr(0, 5) == "HTTP/")
      return bad(505, fmt::format("HTTP version '{}' is not supported (HTTP/1.1 or 1.0)", printable(version)));
    return bad(400, fmt::format("malformed request line '{}'", printable(request_line)));
  }
  forwarded.assign(request_line);
  forwarded += "\r\n";
  int lengths = 0, codings = 0, encodings = 0;
  std::string_view length, coding, encoding, expect;
  bool close_token = false, keep_alive_token = false;
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::string_view line = lines[i];
    if (line[0] == ' ' || line[0] == '\t')
      return bad(400, fmt::format("a folded header line (obsolete line folding): '{}'", printable(line)));
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0)
      return bad(400, fmt::format("a header line without a name: '{}'", printable(line)));
    const std::string_view name = line.substr(0, colon);
    for (char c : name)
      if (!isTokenChar(c)) return bad(400, fmt::format("malformed header name '{}'", printable(name)));
    const std::string_view value = trimOws(line.substr(colon + 1));
    if (iequals(name, "Content-Length")) {
      ++lengths;
      length = value;
    } else if (iequals(name, "Transfer-Encoding")) {
      ++codings;
      coding = value;
    } else if (iequals(name, "Content-Encoding")) {
      ++encodings;
      encoding = value;
    } else if (iequals(name, "Expect")) {
      expect = value;
    } else {
      if (iequals(name, "Connection")) {
        close_token = close_token || listsToken(value, "close");
        keep_alive_token = keep_alive_token || listsToken(value, "keep-alive");
      }
      forwarded.append(name);
      forwarded += ": ";
      forwarded.append(value);
      forwarded += "\r\n";
    }
  }
  // The body's length: one Content-Length, or chunked alone, never both (a front proxy reading
  // the other one would see another request boundary: request smuggling).
  if (codings > 0 && lengths > 0)
    return bad(400, "the request has both Transfer-Encoding and Content-Length: its length is ambiguous");
  if (codings > 1) return bad(400, "the request has two Transfer-Encoding headers");
  if (codings == 1) {
    if (http10) return bad(400, "Transfer-Encoding in an HTTP/1.0 request");
    if (!iequals(coding, "chunked"))
      return bad(501, fmt::format("Transfer-Encoding '{}' is not supported: only chunked", printable(coding)));
    framing.chunked = true;
  }
  if (lengths > 1) return bad(400, "the request has two Content-Length headers");
  if (lengths == 1) {
    if (length.empty() || length.size() > 19 ||
        !std::all_of(length.begin(), length.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return bad(400, fmt::format("Content-Length '{}' is not a length in bytes", printable(length)));
    framing.length = std::stoull(std::string(length));
    if (framing.length > static_cast<uint64_t>(max_body_bytes))
      return bad(413, fmt::format("the body is {} bytes, over --max-request-bytes {}", framing.length,
                                  max_body_bytes));
  }
  if (encodings > 1) return bad(415, "the request has two Content-Encoding headers");
  if (encodings == 1) {
    const std::string e = lowered(encoding);
    if (e == "gzip" || e == "x-gzip") {
      framing.encoding = 1;
    } else if (e == "deflate") {
      framing.encoding = 2;
    } else if (e != "identity") {
      return bad(415, fmt::format("Content-Encoding '{}' is not supported: send the body as it is, gzip or deflate",
                                  printable(encoding)));
    }
  }
  if (!expect.empty()) {
    if (!iequals(expect, "100-continue"))
      return bad(417, fmt::format("Expect '{}' is not supported", printable(expect)));
    framing.expect_continue = !http10;
  }
  framing.close = http10 ? !keep_alive_token : close_token;
  return 0;
}

ChunkedDecoder::State ChunkedDecoder::fail(std::string why) {
  error_ = std::move(why);
  return state_ = State::Malformed;
}

size_t ChunkedDecoder::feed(std::string_view in, std::string& out) {
  size_t i = 0;
  while (i < in.size() && state_ == State::NeedMore) {
    if (phase_ == Phase::Data) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(remaining_, in.size() - i));
      out.append(in.data() + i, n);
      i += n;
      remaining_ -= n;
      if (remaining_ == 0) phase_ = Phase::DataEnd;
      continue;
    }
    // The other phases read a line: a chunk size, the CRLF after a chunk's data, a trailer.
    const size_t nl = in.find('\n', i);
    const size_t take = (nl == std::string_view::npos ? in.size() : nl) - i;
    if (line_.size() + take > kMaxChunkLine) {
      fail(fmt::format("a line of the chunked body is over {} bytes", kMaxChunkLine));
      break;
    }
    line_.append(in.data() + i, take);
    if (nl == std::string_view::npos) {
      i = in.size();
      break;
    }
    i = nl + 1;
    std::string_view line = line_;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    switch (phase_) {
      case Phase::Size: {
        uint64_t size = 0;
        size_t k = 0;
        for (; k < line.size() && k < 16 && std::isxdigit(static_cast<unsigned char>(line[k])); ++k) {
          const char c = lower(line[k]);
          size = size * 16 + static_cast<uint64_t>(c <= '9' ? c - '0' : c - 'a' + 10);
        }
        const std::string_view rest = trimOws(line.substr(k));
        if (k == 0 || k == 16 || (!rest.empty() && rest[0] != ';')) {
          fail(fmt::format("malformed chunk-size line '{}'", printable(line)));
          break;
        }
        if (size == 0) {
          phase_ = Phase::Trailer;
        } else if (decoded_ + size > static_cast<uint64_t>(max_bytes_)) {
          error_ = fmt::format("the chunked body is over --max-request-bytes {}", max_bytes_);
          state_ = State::TooLarge;
        } else {
          decoded_ += size;
          remaining_ = size;
          phase_ = Phase::Data;
        }
        break;
      }
      case Phase::DataEnd:
        if (!line.empty()) {
          fail("a chunk's data is longer than its size says");
          break;
        }
        phase_ = Phase::Size;
        break;
      case Phase::Trailer:
        trailer_bytes_ += static_cast<int64_t>(line_.size());
        if (trailer_bytes_ > kMaxTrailerBytes) {
          fail(fmt::format("the chunked body's trailer is over {} bytes", kMaxTrailerBytes));
          break;
        }
        if (line.empty()) state_ = State::Done;
        break;
      case Phase::Data:
        break;
    }
    line_.clear();
  }
  return i;
}

int inflateBounded(std::string_view in, int encoding, int64_t max_bytes, std::string& out, std::string& error) {
  const char* name = encoding == 1 ? "gzip" : "deflate";
  // "deflate" is a zlib stream (RFC 9110), but some clients send raw deflate: a zlib stream
  // starts with a header whose 16 bits are a multiple of 31.
  int window = 15 + 16;
  if (encoding == 2) {
    const bool zlib_header = in.size() >= 2 && (static_cast<unsigned char>(in[0]) & 0x0f) == 8 &&
                             ((static_cast<unsigned char>(in[0]) << 8) | static_cast<unsigned char>(in[1])) % 31 == 0;
    window = zlib_header ? 15 : -15;
  }
  z_stream zs{};
  if (inflateInit2(&zs, window) != Z_OK) {
    error = fmt::format("cannot start inflating the {} body", name);
    return 400;
  }
  std::vector<unsigned char> buffer(kReadChunk);
  size_t fed = 0;
  int status = 0;
  for (;;) {
    if (zs.avail_in == 0 && fed < in.size()) {
      const size_t n = std::min<size_t>(in.size() - fed, 1u << 30);
      zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data() + fed));
      zs.avail_in = static_cast<uInt>(n);
      fed += n;
    }
    zs.next_out = buffer.data();
    zs.avail_out = static_cast<uInt>(buffer.size());
    const int ret = inflate(&zs, Z_NO_FLUSH);
    const size_t produced = buffer.size() - zs.avail_out;
    if (static_cast<int64_t>(out.size() + produced) > max_bytes) {
      error = fmt::format("the {} body inflates to over --max-request-bytes {} ({} bytes sent)", name,
                          max_bytes, in.size());
      status = 413;
      break;
    }
    out.append(reinterpret_cast<const char*>(buffer.data()), produced);
    if (ret == Z_STREAM_END) {
      // gzip allows several members one after another (gzip -c a b).
      if (encoding == 1 && (zs.avail_in > 0 || fed < in.size())) {
        inflateReset(&zs);
        continue;
      }
      if (zs.avail_in > 0 || fed < in.size()) {
        error = fmt::format("bytes after the end of the {} data", name);
        status = 400;
      }
      break;
    }
    if (ret == Z_BUF_ERROR && zs.avail_in == 0 && fed == in.size()) {
      error = fmt::format("the {} body ends before its data does", name);
      status = 400;
      break;
    }
    if (ret != Z_OK && ret != Z_BUF_ERROR) {
      error = fmt::format("the body is not {} data: {}", name, zs.msg ? zs.msg : "corrupt");
      status = 400;
      break;
    }
  }
  inflateEnd(&zs);
  if (status) out.clear();
  return status;
}

struct ConnectionPool::Conn {
  int fd = -1;
  std::string in;     // received and not yet consumed
  size_t scanned = 0;  // where the search for the head's end resumes
  Clock::time_point since;                      // opened, or last answered
  std::optional<Clock::time_point> first_byte;  // of the request being received
  bool eof = false;                             // the client has shut its side
  bool counted = false;                         // in open_
  bool lingering = false;                       // in lingering_: answered, drained, then closed
  Clock::time_point linger_until;
};

ConnectionPool::ConnectionPool(ConnectionLimits limits, Handler handler)
    : limits_(limits), handler_(std::move(handler)) {
  if (::pipe2(wake_, O_NONBLOCK | O_CLOEXEC) != 0) wake_[0] = wake_[1] = -1;
  poller_ = std::thread([this] { pollLoop(); });
  for (int i = 0; i < std::max(limits_.workers, 1); ++i) workers_.emplace_back([this] { workerLoop(); });
}

ConnectionPool::~ConnectionPool() {
  stop();
  join();
  for (int fd : wake_)
    if (fd >= 0) ::close(fd);
}

void ConnectionPool::adopt(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  auto c = std::make_unique<Conn>();
  c->fd = fd;
  c->since = Clock::now();
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (stopping_) {
      lock.unlock();
      ::close(fd);
      return;
    }
    if (open_ < limits_.max_connections) {
      ++open_;
      c->counted = true;
      to_poll_.push_back(std::move(c));
      (void)!::write(wake_[1], "c", 1);
      return;
    }
  }
  // A fresh socket's send buffer is empty: the answer goes out at once.
  refuse(std::move(c), 503,
         fmt::format("the server has --max-connections {} connections open; try again", limits_.max_connections),
         false);
}

void ConnectionPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  (void)!::write(wake_[1], "s", 1);
  ready_cv_.notify_all();
}

void ConnectionPool::join() {
  if (poller_.joinable()) poller_.join();
  for (std::thread& t : workers_)
    if (t.joinable()) t.join();
}

void ConnectionPool::closeConn(std::unique_ptr<Conn> c) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (c->counted) --open_;
    if (c->lingering) --lingering_;
  }
  ::close(c->fd);
}

void ConnectionPool::toPoller(std::unique_ptr<Conn> c) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      to_poll_.push_back(std::move(c));
      (void)!::write(wake_[1], "r", 1);
      return;
    }
  }
  closeConn(std::move(c));
}

bool ConnectionPool::writeAll(int fd, std::string_view data, Clock::time_point deadline) {
  while (!data.empty()) {
    const ssize_t n = ::send(fd, data.data(), data.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      data.remove_prefix(static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, INT_MAX))) <= 0 && errno != EINTR) return false;
  }
  return true;
}

void ConnectionPool::refuse(std::unique_ptr<Conn> c, int status, const std::string& message, bool wait) {
  const std::string body = json::Json{{"error", message}}.dump(-1, ' ', false, json::Json::error_handler_t::replace);
  const std::string answer = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
      status, reasonPhrase(status), body.size(), body);
  if (!writeAll(c->fd, answer, Clock::now() + std::chrono::milliseconds(wait ? limits_.write_timeout_ms : 0))) {
    closeConn(std::move(c));
    return;
  }
  ::shutdown(c->fd, SHUT_WR);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (c->counted) {
      --open_;
      c->counted = false;
    }
    if (!stopping_ && lingering_ < limits_.max_connections) {
      ++lingering_;
      c->lingering = true;
      c->linger_until = Clock::now() + std::chrono::milliseconds(kLingerMs);
      to_poll_.push_back(std::move(c));
      (void)!::write(wake_[1], "l", 1);
      return;
    }
  }
  closeConn(std::move(c));
}

bool ConnectionPool::receiveHead(Conn& c, bool& ready) {
  char buffer[16 << 10];
  while (c.in.size() <= kMaxHeadBytes && !c.eof) {
    const ssize_t n = ::recv(c.fd, buffer, sizeof(buffer), MSG_DONTWAIT);
    if (n > 0) {
      c.in.append(buffer, static_cast<size_t>(n));
      if (!c.first_byte) c.first_byte = Clock::now();
    } else if (n == 0) {
      c.eof = true;
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      break;
    } else {
      return false;
    }
  }
  skipEmptyLines(c.in, c.scanned);
  ready = headEnd(c.in, c.scanned) != std::string::npos;
  return ready || !c.eof;
}

void ConnectionPool::pollLoop() {
  std::vector<std::unique_ptr<Conn>> conns;
  std::vector<pollfd> fds;
  auto dispatch = [this](std::unique_ptr<Conn> c) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ready_.push_back(std::move(c));
    }
    ready_cv_.notify_one();
  };
  for (;;) {
    bool stopping = false;
    size_t fresh = conns.size();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& c : to_poll_) conns.push_back(std::move(c));
      to_poll_.clear();
      stopping = stopping_;
    }
    if (stopping) {
      // Heads already whole are answered (with Connection: close); everything else closes.
      for (auto& c : conns) {
        bool ready = false;
        if (!c->lingering && receiveHead(*c, ready) && ready)
          dispatch(std::move(c));
        else
          closeConn(std::move(c));
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        poller_done_ = true;
      }
      ready_cv_.notify_all();
      return;
    }
    // Connections handed back by a worker may hold the next request already (pipelining).
    for (size_t i = fresh; i < conns.size(); ++i) {
      Conn& c = *conns[i];
      if (c.lingering) continue;
      skipEmptyLines(c.in, c.scanned);
      if (c.in.empty()) {
        c.first_byte.reset();
      } else if (headEnd(c.in, c.scanned) != std::string::npos) {
        dispatch(std::move(conns[i]));
      }
    }
    conns.erase(std::remove(conns.begin(), conns.end(), nullptr), conns.end());

    const auto now = Clock::now();
    auto deadlineOf = [this](const Conn& c) {
      if (c.lingering) return c.linger_until;
      if (c.first_byte) return *c.first_byte + std::chrono::milliseconds(limits_.header_timeout_ms);
      return c.since + std::chrono::milliseconds(limits_.idle_timeout_ms);
    };
    auto next = now + std::chrono::seconds(1);
    fds.assign(1, pollfd{wake_[0], POLLIN, 0});
    for (const auto& c : conns) {
      fds.push_back(pollfd{c->fd, POLLIN, 0});
      next = std::min(next, deadlineOf(*c));
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
    const int n = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait, 0)));
    if (n < 0 && errno != EINTR) continue;
    if (fds[0].revents) {
      char drain[64];
      while (::read(wake_[0], drain, sizeof(drain)) > 0) {
      }
    }
    const auto after = Clock::now();
    for (size_t i = 0; i < conns.size(); ++i) {
      std::unique_ptr<Conn>& c = conns[i];
      const bool readable = fds[i + 1].revents != 0;
      if (c->lingering) {
        // Unread input is drained so that closing does not reset the connection before the
        // client has read the answer.
        bool done = after >= c->linger_until;
        if (readable && !done) {
          char sink[16 << 10];
          for (;;) {
            const ssize_t r = ::recv(c->fd, sink, sizeof(sink), MSG_DONTWAIT);
            if (r > 0) continue;
            if (r < 0 && errno == EINTR) continue;
            done = r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK);
            break;
          }
        }
        if (done) closeConn(std::move(c));
        continue;
      }
      if (readable) {
        bool ready = false;
        if (!receiveHead(*c, ready)) {
          closeConn(std::move(c));
        } else if (ready) {
          dispatch(std::move(c));
        } else if (c->in.size() > kMaxHeadBytes) {
          refuse(std::move(c), 431, fmt::format("the request line and headers are over {} bytes", kMaxHeadBytes),
                 false);
        }
        if (!c) continue;
      }
      if (after >= deadlineOf(*c)) {
        if (c->first_byte)
          refuse(std::move(c), 408,
                 fmt::format("the request line and headers did not arrive within --header-timeout-ms {}",
                             limits_.header_timeout_ms),
                 false);
        else
          closeConn(std::move(c));  // idle: closed quietly, as keep-alive connections are
      }
    }
    conns.erase(std::remove(conns.begin(), conns.end(), nullptr), conns.end());
  }
}

void ConnectionPool::workerLoop() {
  for (;;) {
    std::unique_ptr<Conn> c;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ready_cv_.wait(lock, [&] { return !ready_.empty() || poller_done_; });
      if (ready_.empty()) return;
      c = std::move(ready_.front());
      ready_.pop_front();
    }
    const bool keep = serve(c);
    if (!c) continue;  // refused: the poller drains and closes it
    if (keep) {
      c->since = Clock::now();
      c->first_byte.reset();
      if (!c->in.empty()) c->first_byte = c->since;
      c->scanned = 0;
      toPoller(std::move(c));
    } else {
      closeConn(std::move(c));
    }
  }
}

bool ConnectionPool::serve(std::unique_ptr<Conn>& c) {
  size_t scanned = 0;
  skipEmptyLines(c->in, scanned);
  const size_t end = headEnd(c->in, scanned);
  const std::string head = c->in.substr(0, end);
  c->in.erase(0, end);
  FramedRequest request;
  BodyFraming framing;
  std::string error;
  if (int status = parseRequestHead(head, limits_.max_body_bytes, request.head, framing, error)) {
    refuse(std::move(c), status, error, true);
    return false;
  }
  if (framing.expect_continue && (framing.chunked || framing.length > c->in.size()))
    if (!writeAll(c->fd, "HTTP/1.1 100 Continue\r\n\r\n",
                  Clock::now() + std::chrono::milliseconds(limits_.write_timeout_ms)))
      return false;
  // The body, within --body-timeout-ms of the head.
  const auto deadline = Clock::now() + std::chrono::milliseconds(limits_.body_timeout_ms);
  auto receive = [&](size_t most) {  // 1: more bytes in c->in; 0: the client closed; -1: timed out
    char buffer[kReadChunk];
    for (;;) {
      const ssize_t n = ::recv(c->fd, buffer, std::min(most, sizeof(buffer)), MSG_DONTWAIT);
      if (n > 0) {
        c->in.append(buffer, static_cast<size_t>(n));
        return 1;
      }
      if (n == 0) return 0;
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return 0;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return -1;
      pollfd p{c->fd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, INT_MAX)));
    }
  };
  const std::string timed_out =
      fmt::format("the request body did not arrive within --body-timeout-ms {}", limits_.body_timeout_ms);
  if (framing.chunked) {
    ChunkedDecoder decoder(limits_.max_body_bytes);
    for (;;) {
      c->in.erase(0, decoder.feed(c->in, request.body));
      if (decoder.state() == ChunkedDecoder::State::Done) break;
      if (decoder.state() != ChunkedDecoder::State::NeedMore) {
        refuse(std::move(c), decoder.state() == ChunkedDecoder::State::TooLarge ? 413 : 400, decoder.error(),
               true);
        return false;
      }
      const int got = receive(kReadChunk);
      if (got == 0) return false;
      if (got < 0) {
        refuse(std::move(c), 408, timed_out, true);
        return false;
      }
    }
  } else {
    const size_t length = static_cast<size_t>(framing.length);
    if (c->in.size() < length) c->in.reserve(length);
    while (c->in.size() < length) {
      const int got = receive(length - c->in.size());
      if (got == 0) return false;
      if (got < 0) {
        refuse(std::move(c), 408, timed_out, true);
        return false;
      }
    }
    request.body = c->in.substr(0, length);
    c->in.erase(0, length);
  }
  if (framing.encoding != 0) {
    std::string inflated;
    if (int status = inflateBounded(request.body, framing.encoding, limits_.max_body_bytes, inflated, error)) {
      refuse(std::move(c), status, error, true);
      return false;
    }
    request.body.swap(inflated);
  }
  request.head += fmt::format("Content-Length: {}\r\n\r\n", request.body.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    request.close = framing.close || c->eof || stopping_;
  }
  const bool ok = handler_(c->fd, request);
  return ok && !request.close;
}

}  // namespace kiln::cli
