// calibrate: fits a profile's effective numbers to a measured report, so that simulating with the fitted
// profile reproduces what the hardware did, and can then predict runs that were not measured (more nodes,
// other sizes).
//
// The simulator is the model being fitted, used as a black box: the measured run is simulated again with
// the profile, then once more per parameter with that parameter nudged, which gives each collective's and
// each kernel's sensitivity to it. Times are linear in latencies and in the inverse of efficiencies (a
// transfer moves its bytes at line rate times efficiency; a kernel runs at peak times efficiency), so one
// linear least-squares fit over all collectives and kernels gives the change of every parameter at once.
// Residuals are relative, so a 10 us all_reduce counts as much as a 10 ms one. The fit is a
// Levenberg-Marquardt iteration: a step that does not lower the error is retried shorter, because the model
// is only piecewise linear (the roofline's max, the slowest link of a path, NCCL's choice of algorithm, a
// launch-bound nccl-tests loop against a kernel-bound one); when the steps stop helping, the sensitivities
// are measured again where the fit has got to, and the iteration goes on while that helps.
//
// Parameters (those the profile has): gpu.compute_efficiency, gpu.memory_efficiency, for each link of the
// path a collective takes (NVLink, PCIe, the NIC) its efficiency and latency, nccl.latency_scale (the
// collectives' fixed latency against NCCL's prediction), gpu.launch_overhead_us (the host's time per launch,
// which nccl-tests' loop shows where a collective is shorter than it), and the fabric's switch latency.
// Only what the simulator's model reads can be fitted: a parameter no collective or kernel depends on is
// left alone (the link latencies, which collectives do not read), and so is one the data cannot tell apart
// from another (a single message size cannot separate latency from bandwidth); the note beside it says
// which.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "common/profile.h"
#include "common/report.h"

namespace ranklab {

struct ParameterFit {
  std::string key;      // the profile key: "nvlink.efficiency"
  double before = 0;    // the profile's value
  double after = 0;     // the fitted value (== before when not fitted)
  int collectives = 0;  // measured collectives that depend on it
  int kernels = 0;      // measured kernels that depend on it
  bool fitted = false;
  std::string note;  // why it was not fitted, or was clamped
};

struct Calibration {
  Profile profile;                 // the input profile with the fitted values in place
  std::vector<ParameterFit> fits;  // one per parameter considered
  std::vector<std::string> notes;  // about the fit as a whole
  int collectives = 0;             // measured collectives matched with the simulation
  int kernels = 0;                 // measured compute spans matched with the simulation
  double error_before = 0;         // geometric-mean error of the simulation against the measurement
  double error_after = 0;          // the same with the fitted profile
  int simulations = 0;             // runs of the simulator it took
  const ParameterFit* find(const std::string& key) const;
};

// Simulates the measured run (same lesson, options and world) with a given profile.
using Simulate = std::function<RunReport(const Profile&)>;
// calibrate() stops fitting after this many simulations (more only when its first probes, one per
// parameter, take more). A sweep of three parameters (bandwidth, latency, launch) takes about 50: 12 probes,
// the steps, and fresh probes of the fitted parameters where the first slopes no longer hold.
constexpr int kCalibrationSimulations = 80;

// Fits `profile` to `measured` by simulating with `simulate`. Raises UsageError when nothing of the report
// matches the simulation (another lesson, a report without collectives or kernels).
Calibration calibrate(const RunReport& measured, const Profile& profile, const Simulate& simulate);

// The profile file's `original` text with each fitted value replaced (or added to its table) and a comment
// above it naming `measured_name`, `date` and the value it replaced; `name` becomes the profile's name. The
// result is checked by parsing it, which raises ProfileError if it does not.
std::string fitted_profile_text(const std::string& original, const Calibration& calibration,
                                const std::string& name, const std::string& measured_name,
                                const std::string& date);

// What was fitted, for the terminal.
std::string format_calibration(const Calibration& calibration);

}  // namespace ranklab
