// An open-loop gRPC load generator in C++, for bench.goodput's overload points (issue 14).
//
// A Python client on one core tops out near the rate the overload bench must offer (4x a cheap
// call's capacity, ~3,000 calls/s), and its own lag is charged to the server. This one spends
// ~10-20 us of CPU per call (gRPC's C++ async API, pre-serialized requests, no protobuf code).
//
//   openloop TARGET RATE SECONDS SEED DEADLINE(0|1) CLASS...
//   CLASS = name:share:budget_ms:request_file   (request_file: one serialized ModelInferRequest)
//
// Poisson arrivals at RATE for SECONDS, each call's class drawn by share; with DEADLINE=1 each call
// carries a gRPC deadline of its class's budget. After the window, answers still owed get the
// longest budget plus a second, then are cancelled (NO_ANSWER). Prints one JSON object: per class
// sent, ok, good (ok within budget), p50/p99 ms of the ok ones, and the status counts.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using Clock = std::chrono::steady_clock;

struct Class {
  std::string name;
  double share = 0, budget_s = 0;
  grpc::ByteBuffer request;
  std::vector<double> ok_latency;
  long sent = 0, good = 0;
  std::map<std::string, long> status;
};

struct Call {
  Class* cls;
  Clock::time_point t0;
  grpc::ClientContext ctx;
  grpc::ByteBuffer response;
  grpc::Status status;
  std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader;
};

static const char* kMethod = "/inference.GRPCInferenceService/ModelInfer";

static std::string code_name(grpc::StatusCode c) {
  static const char* names[] = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
                                "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
                                "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL",
                                "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  int i = static_cast<int>(c);
  return (i >= 0 && i <= 16) ? names[i] : "CODE_" + std::to_string(i);
}

static double pct(std::vector<double> v, double q) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  size_t i = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
  return v[i] * 1e3;
}

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: openloop TARGET RATE SECONDS SEED DEADLINE(0|1) name:share:budget_ms:file...\n");
    return 2;
  }
  std::string target = argv[1];
  double rate = std::stod(argv[2]), seconds = std::stod(argv[3]);
  unsigned seed = static_cast<unsigned>(std::stoul(argv[4]));
  bool deadline = std::string(argv[5]) == "1";
  std::vector<Class> classes;
  for (int i = 6; i < argc; i++) {
    std::stringstream ss(argv[i]);
    std::string name, share, budget, file;
    std::getline(ss, name, ':');
    std::getline(ss, share, ':');
    std::getline(ss, budget, ':');
    std::getline(ss, file);
    std::ifstream in(file, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "openloop: cannot read %s\n", file.c_str());
      return 2;
    }
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    Class c;
    c.name = name;
    c.share = std::stod(share);
    c.budget_s = std::stod(budget) / 1000.0;
    grpc::Slice slice(bytes);
    c.request = grpc::ByteBuffer(&slice, 1);
    classes.push_back(std::move(c));
  }
  std::vector<double> weights;
  double longest = 0;
  for (auto& c : classes) {
    weights.push_back(c.share);
    longest = std::max(longest, c.budget_s);
  }

  const int kChannels = 4;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  for (int i = 0; i < kChannels; i++) {
    grpc::ChannelArguments args;
    args.SetInt("grpc.channel_id", i);  // distinct args: one connection per channel
    args.SetMaxReceiveMessageSize(-1);
    auto ch = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    if (!ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
      std::fprintf(stderr, "openloop: cannot connect to %s\n", target.c_str());
      return 1;
    }
    stubs.push_back(std::make_unique<grpc::GenericStub>(ch));
  }

  grpc::CompletionQueue cq;
  std::mutex mu;  // guards the classes' tallies (the reaper writes, main reads at the end)
  std::atomic<long> outstanding{0};
  std::thread reaper([&] {
    void* tag;
    bool ok;
    while (cq.Next(&tag, &ok)) {
      Call* call = static_cast<Call*>(tag);
      double lat = std::chrono::duration<double>(Clock::now() - call->t0).count();
      {
        std::lock_guard<std::mutex> lock(mu);
        Class* c = call->cls;
        std::string name = code_name(call->status.error_code());
        c->status[name]++;
        if (call->status.ok()) {
          c->ok_latency.push_back(lat);
          if (lat <= c->budget_s) c->good++;
        }
      }
      delete call;
      outstanding--;
    }
  });

  std::mt19937_64 rng(seed);
  std::exponential_distribution<double> gap(rate);
  std::discrete_distribution<int> pick(weights.begin(), weights.end());
  std::vector<Call*> live;
  auto start = Clock::now();
  double t = 0;
  long i = 0;
  while (true) {
    t += gap(rng);
    if (t >= seconds) break;
    auto due = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(t));
    std::this_thread::sleep_until(due);
    Class& c = classes[pick(rng)];
    Call* call = new Call;
    call->cls = &c;
    call->t0 = Clock::now();
    if (deadline)
      call->ctx.set_deadline(std::chrono::system_clock::now() +  // gRPC takes system_clock deadlines
                             std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                 std::chrono::duration<double>(c.budget_s)));
    {
      std::lock_guard<std::mutex> lock(mu);
      c.sent++;
    }
    outstanding++;
    call->reader = stubs[i++ % kChannels]->PrepareUnaryCall(&call->ctx, kMethod, c.request, &cq);
    call->reader->StartCall();
    call->reader->Finish(&call->response, &call->status, call);
  }
  auto give_up = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(longest + 1));
  while (outstanding > 0 && Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  long no_answer = outstanding.load();
  // Whatever is still owed is cancelled by shutting the queue down after the channels go.
  std::string out;
  {
    std::lock_guard<std::mutex> lock(mu);
    std::ostringstream js;
    js << "{\"offered_rps\":" << rate << ",\"seconds\":" << seconds << ",\"no_answer\":" << no_answer << ",\"classes\":{";
    for (size_t k = 0; k < classes.size(); k++) {
      Class& c = classes[k];
      js << (k ? "," : "") << "\"" << c.name << "\":{\"sent\":" << c.sent << ",\"ok\":" << c.ok_latency.size()
         << ",\"good\":" << c.good << ",\"p50_ms\":" << pct(c.ok_latency, 0.5)
         << ",\"p99_ms\":" << pct(c.ok_latency, 0.99) << ",\"status\":{";
      size_t j = 0;
      for (auto& kv : c.status) js << (j++ ? "," : "") << "\"" << kv.first << "\":" << kv.second;
      js << "}}";
    }
    js << "}}";
    out = js.str();
  }
  std::printf("%s\n", out.c_str());
  std::fflush(stdout);
  std::_Exit(0);  // calls still owed are abandoned with the process
}
