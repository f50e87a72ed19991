#include "common/backend.h"

namespace ranklab {

const OptionTable<BackendOptions>& backend_options() {
  using O = BackendOptions;
  static const OptionTable<O> table = {
      {"algo", &O::algo, "force NCCL's algorithm, as NCCL_ALGO: ring, tree, nvls, nvls_tree"},
      {"proto", &O::proto, "force NCCL's protocol, as NCCL_PROTO: ll, ll128, simple"},
      {"no-sm-contention", &O::no_sm_contention,
       "simulator: compute kernels do not share the GPU's SMs and HBM with communication kernels "
       "(docs/model.md)"},
      Option<O>("symmetric", &O::symmetric,
                "gpt, simulator, with --phantom: run one rank per pipeline stage and let the tp and dp "
                "replicas mirror it (tp-dp, the default), or one per stage and dp replica (=tp); with a "
                "skewed --routing, one ep group per stage; same memory and traffic at a fraction of the "
                "cost (docs/lessons/gpt.md says how exact)")
          .choices({"tp", "tp-dp"})
          .implicit("tp-dp"),
      Option<O>(
          "trace-ranks", &O::trace_ranks,
          "the ranks whose every kernel and transfer the report keeps (trace, timeline): all, auto (rank "
          "0 and one rank per pipeline stage; every rank up to 16), or ranks and ranges such as "
          "0,8,16-23; every rank's totals are kept either way")
          .not_identity(),
      Option<O>("trace-format", &O::trace_format,
                "the --report folder's trace: perfetto (trace.perfetto-trace, Perfetto's protobuf format: "
                "ui.perfetto.dev and trace_processor read it) or json (trace.json, Chrome's format)")
          .choices({"perfetto", "json"})
          .not_identity(),
  };
  return table;
}

}  // namespace ranklab
