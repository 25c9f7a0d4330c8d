#include "shared/cluster/etcd_client.h"

#include <curl/curl.h>

#include <mutex>
#include <nlohmann/json.hpp>

namespace keep::cluster {

using json = nlohmann::json;

namespace {

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// etcd's gateway writes int64 fields as strings and leaves zero values out.
int64_t int_field(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_string()) return std::stoll(it->get<std::string>());
  return it->get<int64_t>();
}

Result<KeyValue> parse_kv(const json& j) {
  KeyValue kv;
  KEEP_ASSIGN_OR_RETURN(kv.key, base64_decode(j.value("key", "")));
  KEEP_ASSIGN_OR_RETURN(kv.value, base64_decode(j.value("value", "")));
  kv.create_revision = int_field(j, "create_revision");
  kv.mod_revision = int_field(j, "mod_revision");
  kv.version = int_field(j, "version");
  kv.lease = int_field(j, "lease");
  return kv;
}

// The smallest key greater than every key starting with `prefix` (etcd's range_end for a prefix).
std::string prefix_end(std::string prefix) {
  while (!prefix.empty()) {
    auto& c = reinterpret_cast<unsigned char&>(prefix.back());
    if (c < 0xff) {
      ++c;
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

size_t collect(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

std::once_flag curl_once;

}  // namespace

std::string base64_encode(const std::string& bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{static_cast<unsigned char>(bytes[i])} << 16) |
                       (uint32_t{static_cast<unsigned char>(bytes[i + 1])} << 8) |
                       static_cast<unsigned char>(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out.push_back(kAlphabet[(v >> s) & 63]);
  }
  if (i < bytes.size()) {
    uint32_t v = uint32_t{static_cast<unsigned char>(bytes[i])} << 16;
    if (i + 1 < bytes.size()) v |= uint32_t{static_cast<unsigned char>(bytes[i + 1])} << 8;
    out.push_back(kAlphabet[(v >> 18) & 63]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(i + 1 < bytes.size() ? kAlphabet[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

Result<std::string> base64_decode(const std::string& text) {
  if (text.size() % 4 != 0)
    return Status(Code::kInvalidArgument, "base64: length not a multiple of 4");
  std::string out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    uint32_t v = 0;
    int pad = 0;
    for (size_t k = 0; k < 4; ++k) {
      const char c = text[i + k];
      int d;
      if (c >= 'A' && c <= 'Z')
        d = c - 'A';
      else if (c >= 'a' && c <= 'z')
        d = c - 'a' + 26;
      else if (c >= '0' && c <= '9')
        d = c - '0' + 52;
      else if (c == '+')
        d = 62;
      else if (c == '/')
        d = 63;
      else if (c == '=' && i + 4 == text.size() && k >= 2) {
        d = 0;
        ++pad;
      } else
        return Status(Code::kInvalidArgument, "base64: bad character");
      if (pad > 0 && c != '=') return Status(Code::kInvalidArgument, "base64: data after padding");
      v = (v << 6) | static_cast<uint32_t>(d);
    }
    out.push_back(static_cast<char>((v >> 16) & 0xff));
    if (pad < 2) out.push_back(static_cast<char>((v >> 8) & 0xff));
    if (pad < 1) out.push_back(static_cast<char>(v & 0xff));
  }
  return out;
}

struct EtcdClient::Impl {
  EtcdOptions opt;
  CURL* curl = nullptr;
  size_t current = 0;  // the member that answered last

  ~Impl() {
    if (curl != nullptr) curl_easy_cleanup(curl);
  }

  // POSTs `body` to `path` on one member after another; the parsed answer of the first that
  // answers. An answer with an "error" (etcd refused the call) is returned as that error.
  Result<json> call(const std::string& path, const json& body) {
    const std::string payload = body.dump();
    std::string last_error;
    for (size_t tried = 0; tried < opt.endpoints.size(); ++tried) {
      const size_t m = (current + tried) % opt.endpoints.size();
      const std::string url = opt.endpoints[m] + path;
      std::string answer;
      curl_easy_reset(curl);
      curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
      curl_easy_setopt(curl, CURLOPT_POSTFIELDS, payload.c_str());
      curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE, static_cast<long>(payload.size()));
      curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, static_cast<long>(opt.timeout.count()));
      curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(opt.timeout.count()));
      curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
      curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, collect);
      curl_easy_setopt(curl, CURLOPT_WRITEDATA, &answer);
      const CURLcode rc = curl_easy_perform(curl);
      long http = 0;
      curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &http);
      if (rc != CURLE_OK || http >= 500) {
        last_error = opt.endpoints[m] + ": " +
                     (rc != CURLE_OK ? curl_easy_strerror(rc) : "HTTP " + std::to_string(http));
        continue;  // next member
      }
      json j = json::parse(answer, nullptr, false);
      if (j.is_discarded()) {
        return Status(Code::kInternal, "etcd " + path + ": an answer that is not JSON");
      }
      current = m;
      if (j.contains("error") || j.contains("code")) {
        const std::string msg = j.value("message", j.value("error", std::string("refused")));
        return Status(
            msg.find("not found") != std::string::npos ? Code::kNotFound : Code::kInvalidArgument,
            "etcd " + path + ": " + msg);
      }
      return j;
    }
    return Status(Code::kUnavailable, "etcd " + path + ": no member answered (" + last_error + ")");
  }
};

Result<std::unique_ptr<EtcdClient>> EtcdClient::create(EtcdOptions options) {
  if (options.endpoints.empty()) return Status(Code::kInvalidArgument, "etcd: no endpoints");
  std::call_once(curl_once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
  auto impl = std::make_unique<Impl>();
  impl->opt = std::move(options);
  impl->curl = curl_easy_init();
  if (impl->curl == nullptr) return Status(Code::kInternal, "etcd: curl_easy_init failed");
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(impl)));
}

EtcdClient::EtcdClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
EtcdClient::~EtcdClient() = default;

const std::string& EtcdClient::current_endpoint() const {
  return impl_->opt.endpoints[impl_->current];
}

Result<int64_t> EtcdClient::grant_lease(int64_t ttl_seconds) {
  KEEP_ASSIGN_OR_RETURN(json j, impl_->call("/v3/lease/grant", {{"TTL", ttl_seconds}}));
  const int64_t id = int_field(j, "ID");
  if (id == 0) return Status(Code::kInternal, "etcd lease grant: no lease id");
  return id;
}

Result<int64_t> EtcdClient::keep_alive(int64_t lease) {
  KEEP_ASSIGN_OR_RETURN(json j,
                        impl_->call("/v3/lease/keepalive", {{"ID", std::to_string(lease)}}));
  const json& r = j.contains("result") ? j["result"] : j;
  const int64_t ttl = int_field(r, "TTL");
  if (ttl <= 0) return Status(Code::kNotFound, "etcd lease " + std::to_string(lease) + " is gone");
  return ttl;
}

Status EtcdClient::revoke(int64_t lease) {
  return impl_->call("/v3/lease/revoke", {{"ID", std::to_string(lease)}}).status();
}

Status EtcdClient::put(const std::string& key, const std::string& value, int64_t lease) {
  json body = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  return impl_->call("/v3/kv/put", body).status();
}

Result<std::optional<KeyValue>> EtcdClient::get(const std::string& key) {
  KEEP_ASSIGN_OR_RETURN(json j, impl_->call("/v3/kv/range", {{"key", base64_encode(key)}}));
  if (!j.contains("kvs") || j["kvs"].empty()) return std::optional<KeyValue>();
  KEEP_ASSIGN_OR_RETURN(KeyValue kv, parse_kv(j["kvs"][0]));
  return std::optional<KeyValue>(std::move(kv));
}

Result<std::vector<KeyValue>> EtcdClient::get_prefix(const std::string& prefix) {
  KEEP_ASSIGN_OR_RETURN(
      json j, impl_->call("/v3/kv/range", {{"key", base64_encode(prefix)},
                                           {"range_end", base64_encode(prefix_end(prefix))}}));
  std::vector<KeyValue> out;
  if (j.contains("kvs")) {
    for (const json& e : j["kvs"]) {
      KEEP_ASSIGN_OR_RETURN(KeyValue kv, parse_kv(e));
      out.push_back(std::move(kv));
    }
  }
  return out;
}

Status EtcdClient::del(const std::string& key) {
  return impl_->call("/v3/kv/deleterange", {{"key", base64_encode(key)}}).status();
}

Result<TxnResult> EtcdClient::txn(const std::vector<Compare>& compares,
                                  const std::vector<TxnOp>& ops) {
  json cmp = json::array();
  for (const Compare& c : compares) {
    json e = {{"key", base64_encode(c.key)}, {"result", "EQUAL"}};
    switch (c.target) {
      case Compare::Target::kCreateRevision:
        e["target"] = "CREATE";
        e["create_revision"] = std::to_string(c.revision);
        break;
      case Compare::Target::kModRevision:
        e["target"] = "MOD";
        e["mod_revision"] = std::to_string(c.revision);
        break;
      case Compare::Target::kValue:
        e["target"] = "VALUE";
        e["value"] = base64_encode(c.value);
        break;
    }
    cmp.push_back(std::move(e));
  }
  json success = json::array();
  for (const TxnOp& op : ops) {
    if (op.kind == TxnOp::Kind::kPut) {
      json put = {{"key", base64_encode(op.key)}, {"value", base64_encode(op.value)}};
      if (op.lease != 0) put["lease"] = std::to_string(op.lease);
      success.push_back({{"request_put", std::move(put)}});
    } else {
      success.push_back({{"request_delete_range", {{"key", base64_encode(op.key)}}}});
    }
  }
  KEEP_ASSIGN_OR_RETURN(json j,
                        impl_->call("/v3/kv/txn", {{"compare", cmp}, {"success", success}}));
  TxnResult r;
  r.succeeded = j.value("succeeded", false);
  if (j.contains("header")) r.revision = int_field(j["header"], "revision");
  return r;
}

}  // namespace keep::cluster
